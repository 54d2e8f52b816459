"""`ServingLoop`: what the HTTP side needs from whatever runs the engine, one engine thread
(engine_loop.py) or a pool of replica processes (pool.py).

All methods may be called from any thread; `submit`'s sinks receive their updates on their own
event loops (`publish`). `health()` is read by /health; `collectors()` adds Prometheus
collectors of the loop's own (the per-replica gauges) to /metrics; `replica_stats()` and
`flush_cache()` serve SGLang's /get_load and /flush_cache (sglang_api.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from minisched.serve.messages import Sink, Stats, Update

log = logging.getLogger("minisched.serve")


@dataclass(frozen=True)
class LoopHealth:
    alive: bool  # the loop runs (some replica serves)
    failure: Optional[str] = None  # why no request can succeed any more (a tensor-parallel rank died)
    replicas: Optional[list[dict]] = None  # --dp: one row per replica
    degraded: bool = False  # --dp: some replica is down, the others serve

    def as_json(self) -> dict:
        return {} if self.replicas is None else {"replicas": self.replicas}


class ServingLoop(Protocol):
    stats: Stats

    def start(self) -> ServingLoop: ...

    def is_alive(self) -> bool: ...

    def submit(
        self, rids: list[str], prompt_ids: list[int], sampling: Any, sinks: list[Sink], client_id: Optional[str] = None
    ) -> None:
        """One prompt's len(rids) choices (OpenAI's `n`), each its own request id and sink; `client_id`: the
        client's X-Request-Id, for the records (`serve --record`)."""

    def abort(self, rid: str) -> None: ...

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future: ...

    def call_all(self, fn: Callable[[Any], Any]) -> list[concurrent.futures.Future]:
        """`fn(engine)` on every serving engine's thread (fn picklable: replicas run in processes)."""

    def stop(self) -> None: ...

    def join(self, timeout: Optional[float] = None) -> None: ...

    def health(self) -> LoopHealth: ...

    def collectors(self) -> list: ...

    def replica_stats(self) -> list[Stats]:
        """One Stats per engine replica (one for a single engine): SGLang's /get_load rows."""

    def flush_cache(self, timeout: float = 60.0) -> int:
        """Empty every replica's prefix cache (and, --dp, the router's trees); the pages freed."""


def publish(items: list[tuple[Sink, Update]]) -> None:
    """Hand updates to their sinks: one `call_soon_threadsafe` per event loop for all its updates."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for sink, upd in items:
        by_loop.setdefault(sink.loop, []).append((sink, upd))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(deliver_all, batch)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            pass


def deliver_all(batch: list[tuple[Sink, Update]]) -> None:
    for sink, upd in batch:
        try:
            sink.deliver(upd)
        except Exception:  # one broken sink must not starve the others
            log.error("sink error:\n%s", traceback.format_exc())
