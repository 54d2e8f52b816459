"""What the engine loop hands its scheduler's records to when the server records (`minisched serve --record`).

The engine loop (engine_loop.py) calls a `Recorder` on its own thread and never waits on it: `calls` after
a call's requests were added (the client's X-Request-Id and the engine request ids), `write` with the
records taken since the last write (every `interval` seconds while there is something new, and before
each drain of the scheduler's records), `close` when the loop stops. observe/record_series.py implements
it (a rotating series of run files, written on a thread of its own); the CLI builds it, since this layer
does not import observe.
"""

from __future__ import annotations

from typing import Protocol

from minisched.sched.snapshot import Records


class Recorder(Protocol):
    interval: float  # seconds between hand-overs of what is new: the files lag the engine by about this much

    def calls(self, client_id: str, rids: list[str]) -> None:
        """The client's id names these engine requests (one call's choices)."""

    def write(self, records: Records) -> None:
        """Records new since the last write, in order (queued: the caller does not wait for the disk)."""

    def close(self) -> None:
        """Write what is queued and stop."""
