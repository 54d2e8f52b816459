"""Data parallelism: N engine replicas (processes) behind one server, with cache-aware routing.

    pool = DataParallelLoop([functools.partial(Engine, "smollm2")] * 2, RouterConfig("cache-aware")).start()
    app = create_app(pool.info, model_name="smollm2", engine_loop=pool)   # the HTTP layer is unchanged

`DataParallelLoop` is a `ServingLoop` (serve/loop.py) as `EngineLoop` is, so `ServerState` and
the routes use it as they use one engine loop. `submit` routes
each request (`router.py`) to a `ReplicaClient` (`replica.py`); the router's load is each
replica's requests in flight. A replica that dies is removed from routing by its reader
thread (its in-flight requests fail with a server error); a request routed to it in that
instant is routed again. The server stays up while one replica lives: `/health` answers
"degraded" with 200, and 503 only when none is left.

`factories[i]` builds replica i's Engine in its process (a picklable zero-argument callable).
With `pin_cpus` and at least one core per replica, replica i is pinned to its own share of
the cores, so the replicas' thread pools do not fight over them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from minisched.serve.loop import LoopHealth, publish
from minisched.serve.messages import Stats, Update
from minisched.serve.replica import EngineInfo, ReplicaClient, ReplicaStartError
from minisched.serve.router import NoReplicaError, Router, RouterConfig

log = logging.getLogger("minisched.serve")


def split_cpus(n: int) -> list[Optional[list[int]]]:
    """Replica i's cores: a contiguous share of this process's cores, or None (no pinning) when
    there are fewer cores than replicas."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return [None] * n
    if len(cores) < n:
        return [None] * n
    k = len(cores) // n
    return [cores[i * k : (i + 1) * k] for i in range(n)]


class DataParallelLoop:
    def __init__(
        self,
        factories: Sequence[Callable[[], Any]],
        router: RouterConfig = RouterConfig(),
        *,
        pin_cpus: bool = True,
        start_timeout: float = 600.0,
        check_invariants: bool = False,
    ):
        if len(factories) < 1:
            raise ValueError("data parallelism needs at least one replica")
        self.factories, self.router_config = list(factories), router
        self.pin_cpus, self.start_timeout, self.check_invariants = pin_cpus, start_timeout, check_invariants
        self.replicas: list[ReplicaClient] = []
        self.router: Optional[Router] = None
        self.info: Optional[EngineInfo] = None
        self._lock = threading.Lock()  # guards the router (event loop + reader threads)
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> DataParallelLoop:
        """Spawn every replica and wait until all are ready; one that fails stops them all."""
        if self._started:
            return self
        self._started = True
        cpus = split_cpus(len(self.factories)) if self.pin_cpus else [None] * len(self.factories)
        self.replicas = [
            ReplicaClient(i, f, on_death=self._replica_died, cpus=cpus[i], check_invariants=self.check_invariants)
            for i, f in enumerate(self.factories)
        ]
        deadline = time.monotonic() + self.start_timeout
        try:
            infos = [r.wait_ready(max(0.0, deadline - time.monotonic())) for r in self.replicas]
        except ReplicaStartError:
            self.stop()
            self.join(10)
            raise
        self.info = infos[0]
        sc = self.info.sched_config
        # The router's tree per replica holds about what that replica's KV pool can.
        self.router = Router(
            self.router_config,
            len(self.replicas),
            chunk=sc.page_size,
            max_tree_tokens=max(sc.page_size, sc.num_pages * sc.page_size),
        )
        return self

    def is_alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        for r in self.replicas:
            r.join(max(0.1, deadline - time.monotonic()))

    # -- requests (from the event loop) ---------------------------------------------------------
    def submit(self, rids: list[str], prompt_ids: list[int], sampling, sinks: list) -> None:
        """A prompt's choices go to one replica together: they share its prefill there."""
        while True:
            with self._lock:
                for i, r in enumerate(self.replicas):
                    self.router.load[i] = r.in_flight
                try:
                    i = self.router.route(prompt_ids)
                except NoReplicaError as exc:
                    publish([(sink, Update([], "error", str(exc), "server_error")) for sink in sinks])
                    return
            if self.replicas[i].submit(rids, prompt_ids, sampling, sinks):
                return
            self._replica_died(i)  # it died between the route and the send: route again

    def abort(self, rid: str) -> None:
        for r in self.replicas:
            if r.has(rid):
                r.abort(rid)

    def call_all(self, fn: Callable[[Any], Any]) -> list[concurrent.futures.Future]:
        """`fn(engine)` on every live replica's engine thread (fn must be picklable)."""
        return [r.call(fn) for r in self.replicas if r.alive]

    def call(self, fn):
        raise NotImplementedError("with --dp there is no single engine: use call_all(fn) (a picklable fn)")

    def _replica_died(self, index: int) -> None:
        with self._lock:
            if self.router is not None and self.router.alive[index]:
                self.router.remove(index)
                log.error(
                    "engine replica %d removed from routing; %d of %d left",
                    index,
                    len(self.router.live()),
                    len(self.replicas),
                )

    # -- admin and observation ------------------------------------------------------------------
    def set_policy(self, config: RouterConfig) -> None:
        """Switch the routing policy (benchmarks); the prefix trees start empty."""
        with self._lock:
            self.router.config = config
            self.router.reset()

    def flush_caches(self, timeout: float = 60.0) -> int:
        """Empty every live replica's radix cache and the router's trees; returns the pages freed."""
        freed = sum(f.result(timeout) for f in self.call_all(flush_radix_cache))
        with self._lock:
            self.router.reset()
        return freed

    @property
    def stats(self) -> Stats:
        """The live replicas' Stats, summed (the /metrics gauges)."""
        live = [r.stats for r in self.replicas if r.alive]
        if not live:
            return Stats()
        total = {f.name: sum(getattr(s, f.name) for s in live) for f in dataclasses.fields(Stats) if f.name != "time"}
        return Stats(**total)

    def collectors(self) -> list:
        return [ReplicaCollector(self)]

    def health(self) -> LoopHealth:
        alive = sum(r.alive for r in self.replicas)
        return LoopHealth(
            alive=self.is_alive(),
            replicas=[self.replica_status(r) for r in self.replicas],
            degraded=0 < alive < len(self.replicas),
        )

    def replica_status(self, r: ReplicaClient) -> dict:
        out = {
            "index": r.index,
            "alive": r.alive,
            "pid": r.process.pid,
            "in_flight": r.in_flight,
            "routed": self.router.routed[r.index] if self.router else 0,
            "finished": r.requests,
            "failed": r.failed,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "cache_hit_rate": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
        }
        if not r.alive and r.error:
            out["error"] = r.error
        return out


class ReplicaCollector:
    """Per-replica Prometheus gauges for /metrics (the engine gauges there are the replicas' sums)."""

    def __init__(self, pool: DataParallelLoop):
        self.pool = pool

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        rows = [self.pool.replica_status(r) for r in self.pool.replicas]
        for name, doc, key in (
            ("minisched_dp_replica_up", "1 while the replica process serves", "alive"),
            ("minisched_dp_replica_requests_in_flight", "requests routed there, not finished", "in_flight"),
            ("minisched_dp_replica_cache_hit_rate", "cached prompt tokens / prompt tokens", "cache_hit_rate"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for row in rows:
                g.add_metric([str(row["index"])], float(row[key]))
            yield g


def flush_radix_cache(engine) -> int:
    """On a replica's engine thread: evict every unlocked page of the radix cache; the pages freed."""
    sched = engine.scheduler
    pages = sched.tree.evict(sched.tree.total_pages)
    sched.pool.free(pages)
    return len(pages)
