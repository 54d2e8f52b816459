"""Running the app: uvicorn, with a graceful drain on SIGTERM / Ctrl-C.

    run(app, host="127.0.0.1", port=30000, grace_period=30.0)   # blocks; returns after a clean shutdown

On the first SIGTERM or SIGINT the server stops accepting connections, answers new requests
on open connections with 503, lets the requests in flight finish for `grace_period` seconds,
then aborts the rest (their streams end with finish_reason "abort"), stops the engine thread
and returns -- the process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import logging
import socket
from typing import Optional

import uvicorn

log = logging.getLogger("minisched.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the app's requests first (`ServerState.drain`), and
    which does not re-raise the caught signal afterwards (uvicorn does, which would turn a
    clean shutdown into exit status 143 / a KeyboardInterrupt)."""

    def __init__(self, config: uvicorn.Config, grace_period: float):
        super().__init__(config)
        self.grace_period = grace_period

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        for server in self.servers:  # stop accepting first
            server.close()
        server_state = getattr(getattr(self.config.app, "state", None), "server", None)  # create_app's ServerState
        if server_state is not None and not self.force_exit:
            live = len(server_state.live)
            if live:
                log.info("draining %d request(s) for up to %.0f s", live, self.grace_period)
            aborted = await server_state.drain(self.grace_period)
            if aborted:
                log.info("aborted %d request(s) after the grace period", aborted)
        await super().shutdown(sockets)


def make_server(
    app, host: str = "127.0.0.1", port: int = 30000, grace_period: float = 30.0, log_level: str = "info"
) -> DrainingServer:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10, access_log=False, lifespan="on"
    )
    return DrainingServer(config, grace_period)


def run(app, host: str = "127.0.0.1", port: int = 30000, grace_period: float = 30.0, log_level: str = "info") -> None:
    make_server(app, host, port, grace_period, log_level).run()
