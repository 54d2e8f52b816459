"""Helpers for the serve tests. Servers: uvicorn on 127.0.0.1, a free port, in a background thread, stopped by the test.

`running_server(engine, **create_app_kwargs)` is a context manager yielding a `LiveServer`
(base URL, the app's ServerState, the EngineLoop). The engine loop checks the scheduler's
invariants after every step (`check_invariants=True`); tests read `loop.invariant_errors`.
Anything that must touch the engine while the server runs goes through `live.call(fn)`,
which runs `fn(engine)` on the engine thread between steps.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

from minisched.serve import EngineLoop, create_app, make_server

TINY = "dummy:tiny"


def wait_for(pred, timeout: float, what: str, every: float = 0.05):
    """Poll `pred` until it returns something truthy (returned), or fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class LiveServer:
    url: str
    state: object
    loop: EngineLoop
    server: object

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def call(self, fn, timeout: float = 30.0):
        return self.loop.call(fn).result(timeout)


@contextlib.contextmanager
def running_server(
    engine, *, model_name: str = "tiny", check_invariants: bool = True, grace_period: float = 5.0, **kwargs
):
    loop = EngineLoop(engine, check_invariants=check_invariants)
    app = create_app(engine, model_name=model_name, engine_loop=loop, **kwargs)
    server = make_server(app, grace_period=grace_period, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app.state.server, loop, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"
        assert not loop.is_alive(), "the engine loop did not stop"


def pool_whole(engine) -> tuple[int, int, int]:
    """On the engine thread: check the invariants, empty the radix cache, and return
    (free pages, cached pages, total pages) -- a leak-free pool has free == total."""
    sched = engine.scheduler
    sched.check_invariants()
    sched.flush_cache()
    snap = sched.snapshot()
    return snap.pages_free, snap.pages_cached, snap.pages_total


@contextlib.contextmanager
def pool_server(factories, *, router=None, supervision=None, start_timeout: float = 120.0, recorder=None):
    """An EnginePool (engine processes) behind a live server; yields (base URL, pool). At the end every
    replica process must be gone and none may have broken the scheduler's invariants."""
    from minisched.serve.pool import EnginePool, Supervision
    from minisched.serve.router import RouterConfig

    pool = EnginePool(
        factories,
        router or RouterConfig(),
        check_invariants=True,
        start_timeout=start_timeout,
        supervision=supervision or Supervision(),
        recorder=recorder,
    ).start()
    server = None
    try:
        app = create_app(pool.info, model_name="tiny", engine_loop=pool)
        server = make_server(app, grace_period=2.0, log_level="warning")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", pool
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(30)
            sock.close()
        pool.stop()
        pool.join(20)
        assert not any(r.process.is_alive() for r in pool.replicas), "a replica process outlived the server"
    assert all(r.invariant_errors == 0 for r in pool.replicas)
