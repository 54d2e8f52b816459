"""The engine processes behind one server -- one for `--dp 1`, N for `--dp N`, the same code --
with cache-aware routing and a supervisor.

    pool = EnginePool([functools.partial(Engine, "smollm2")] * 2, RouterConfig("cache-aware")).start()
    app = create_app(pool.info, model_name="smollm2", engine_loop=pool)   # the HTTP layer is unchanged

`EnginePool` is a `ServingLoop` (serve/loop.py) as the in-process `EngineLoop` is, so
`ServerState` and the routes use it the same way. `submit` routes each prompt's group of
choices (`router.py`) to a `ReplicaClient` (`replica.py`); the router's load is each
replica's requests in flight.

Supervision (`Supervision`; a monitor thread, every MONITOR_INTERVAL):
- a replica whose process died (the pipe's EOF: at once) or that is hung -- no message for
  `heartbeat_timeout` seconds (SIGSTOP, a deadlock, a native call that never returns), or one
  step running for `step_timeout` seconds (SGLang's watchdog) -- is killed and removed from
  routing. Its requests that the client has seen tokens of end with a server error (HTTP 500,
  or an error event in the stream); those that have not started are routed again, once, to
  another replica or to its restarted process (they wait up to `retry_wait` for one).
- it is restarted with the same factory after a backoff (1, 2, 4, ... s, capped at 30), at
  most `max_restarts` times in `restart_window` seconds; then it gives up with one log line.
- `/health`: 200 "ok" while every replica serves, 200 "degraded" while some do, 503 while none
  does (restarting or given up); each replica's row says which.

`factories[i]` builds replica i's Engine in its process (a picklable zero-argument callable);
`recorder(i)`, if given, builds replica i's Recorder there (serve/recorder.py; `serve --record`): every
process it starts -- the first and each restart -- records a series of its own.
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
from dataclasses import dataclass, field
from typing import Any, Optional

from minisched.base.flags import flag
from minisched.serve.cache_admin import flush_engine_cache
from minisched.serve.loop import LoopHealth, publish
from minisched.serve.messages import Stats, Update
from minisched.serve.replica import BEAT_INTERVAL, EngineInfo, Group, ReplicaClient, ReplicaStartError
from minisched.serve.router import NoReplicaError, Router, RouterConfig

log = logging.getLogger("minisched.serve")
MONITOR_INTERVAL = 0.25
RESTART_WINDOW = 600.0  # seconds: Supervision.restart_window's default


@dataclass(frozen=True)
class Supervision:
    # the flags: `minisched serve --engine-heartbeat-timeout ...`
    heartbeat_timeout: float = flag(
        10.0, f"seconds without a heartbeat (sent every {BEAT_INTERVAL:g} s) before an engine process counts as hung"
    )
    step_timeout: float = flag(  # SGLang's watchdog default
        300.0, "seconds one engine step may run before the process counts as hung"
    )
    max_restarts: int = flag(
        5,
        f"restarts of an engine process within {RESTART_WINDOW / 60:g} minutes before it is given up (0: never restart)",
    )
    restart_window: float = RESTART_WINDOW
    retry_wait: float = 120.0  # how long a request to retry waits for a replica to serve it
    restart: bool = True

    def __post_init__(self):
        for name in ("heartbeat_timeout", "step_timeout", "restart_window", "retry_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


@dataclass
class _Slot:
    index: int
    factory: Callable[[], Any]
    cpus: Optional[list[int]]
    client: Optional[ReplicaClient] = None
    state: str = "starting"  # starting | serving | restarting | given up | stopped
    restarts: list[float] = field(default_factory=list)  # when each restart was made
    next_start: float = 0.0  # monotonic time of the next restart (state "restarting")
    why: Optional[str] = None  # the last death's reason

    @property
    def replica(self) -> ReplicaClient:
        """The slot's client: every slot has one from EnginePool.start on."""
        if self.client is None:
            raise RuntimeError(f"engine replica {self.index} was never spawned: call EnginePool.start() first")
        return self.client


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


class EnginePool:
    def __init__(
        self,
        factories: Sequence[Callable[[], Any]],
        router: RouterConfig = RouterConfig(),
        *,
        pin_cpus: bool = True,
        start_timeout: float = 600.0,
        check_invariants: bool = False,
        supervision: Supervision = Supervision(),
        recorder: Optional[Callable[[int], Any]] = None,
    ):
        if len(factories) < 1:
            raise ValueError("an engine pool needs at least one replica")
        self.router_config, self.supervision = router, supervision
        self.start_timeout, self.check_invariants = start_timeout, check_invariants
        self.recorder = recorder  # picklable: replica index -> its Recorder, built in the replica process
        cpus = split_cpus(len(factories)) if pin_cpus else [None] * len(factories)
        self.slots = [_Slot(i, f, cpus[i]) for i, f in enumerate(factories)]
        self.router: Optional[Router] = None
        self.info: Optional[EngineInfo] = None
        self._lock = threading.RLock()  # guards the router, the slots and the retry queue
        self._retry: list[tuple[float, Group]] = []  # (deadline, group) waiting for a serving replica
        self._started = self._stopping = False
        self._monitor = threading.Thread(target=self._watch, name="minisched-pool-monitor", daemon=True)

    @property
    def replicas(self) -> list[ReplicaClient]:
        return [s.replica for s in self.slots]

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> EnginePool:
        """Spawn every replica and wait until all are ready; one that fails stops them all."""
        if self._started:
            return self
        self._started = True
        for s in self.slots:
            s.client = self._spawn(s)
        deadline = time.monotonic() + self.start_timeout
        try:
            infos = [s.replica.wait_ready(max(0.0, deadline - time.monotonic())) for s in self.slots]
        except ReplicaStartError:
            self.stop()
            self.join(10)
            raise
        self.info = infos[0]
        sc = self.info.sched_config
        # The router's tree per replica holds about what that replica's KV pool can.
        self.router = Router(
            self.router_config,
            len(self.slots),
            chunk=sc.page_size,
            max_tree_tokens=max(sc.page_size, sc.num_pages * sc.page_size),
        )
        with self._lock:
            for s in self.slots:
                s.state = "serving" if s.replica.alive else "restarting"
        self._monitor.start()
        return self

    def _spawn(self, slot: _Slot) -> ReplicaClient:
        return ReplicaClient(
            slot.index,
            slot.factory,
            on_death=self._replica_died,
            cpus=slot.cpus,
            check_invariants=self.check_invariants,
            recorder=self.recorder,
        )

    def is_alive(self) -> bool:
        return any(s.state == "serving" and s.replica.alive for s in self.slots)

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            retry, self._retry = self._retry, []
        publish([(sink, Update([], "abort")) for _, g in retry for sink in g.sinks])
        for s in self.slots:
            if s.client is not None:
                s.client.stop()

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (30.0 if timeout is None else timeout)
        for s in self.slots:
            if s.client is not None:
                s.client.join(max(0.1, deadline - time.monotonic()))

    # -- requests (from the event loop) ---------------------------------------------------------
    def submit(
        self, rids: list[str], prompt_ids: list[int], sampling, sinks: list, client_id: Optional[str] = None
    ) -> None:
        """A prompt's choices go to one replica together: they share its prefill there."""
        self._route(Group(list(rids), prompt_ids, sampling, list(sinks), client_id))

    def _route(self, group: Group) -> None:
        while True:
            with self._lock:
                serving = [s.index for s in self.slots if s.state == "serving" and s.replica.alive]
                if not serving:
                    if group.retried and not self._stopping and self._restart_pending():
                        self._retry.append((time.monotonic() + self.supervision.retry_wait, group))
                        return
                    why = "no engine replica is serving"
                    publish([(sink, Update([], "error", why, "server_error")) for sink in group.sinks])
                    return
                router = self._started_router()  # a replica serves: the pool has started
                for s in self.slots:
                    router.load[s.index] = s.replica.in_flight if s.replica.alive else 0
                try:
                    i = router.route(group.prompt_ids)
                except NoReplicaError as exc:
                    publish([(sink, Update([], "error", str(exc), "server_error")) for sink in group.sinks])
                    return
                client = self.slots[i].replica
            if client.submit(group):
                return
            self._unroute(i)  # it died between the route and the send: route again

    def abort(self, rid: str) -> None:
        with self._lock:
            for k, (_, g) in enumerate(self._retry):
                if rid in g.rids:
                    del self._retry[k]
                    publish([(sink, Update([], "abort")) for sink in g.sinks])
                    return
        for s in self.slots:
            if s.client is not None and s.client.has(rid):
                s.client.abort(rid)

    def call_all(self, fn: Callable[[Any], Any]) -> list[concurrent.futures.Future]:
        """`fn(engine)` on every serving replica's engine thread (fn must be picklable)."""
        return [s.client.call(fn) for s in self.slots if s.client is not None and s.client.alive]

    def call(self, fn) -> concurrent.futures.Future:
        """`fn(engine)` on replica 0 (one engine: `--dp 1`); with several use call_all."""
        if len(self.slots) != 1:
            raise NotImplementedError("with --dp there is no single engine: use call_all(fn) (a picklable fn)")
        return self.slots[0].replica.call(fn)

    def _started_router(self) -> Router:
        if self.router is None:
            raise RuntimeError("the engine pool has not started: call EnginePool.start() first")
        return self.router

    # -- supervision ----------------------------------------------------------------------------
    def _unroute(self, index: int) -> None:
        with self._lock:
            if self.router is not None and self.router.alive[index]:
                self.router.remove(index)

    def _replica_died(self, index: int, was_alive: bool, retry: list[Group]) -> None:
        """A replica's reader saw its end (any cause); `retry`: its groups not started anywhere yet."""
        with self._lock:
            slot = self.slots[index]
            self._unroute(index)
            if self._stopping or not self._started:
                slot.state = "stopped"
            elif slot.state != "given up":
                now = time.monotonic()
                slot.why = slot.replica.error
                recent = [t for t in slot.restarts if now - t < self.supervision.restart_window]
                if not self.supervision.restart or len(recent) >= self.supervision.max_restarts:
                    slot.state = "given up"
                    log.error(
                        "engine replica %d gave up after %d restarts in %.0f s: %s",
                        index,
                        len(recent),
                        self.supervision.restart_window,
                        slot.why,
                    )
                else:
                    slot.state = "restarting"
                    slot.next_start = now + min(30.0, 2.0 ** len(recent))
                    log.error(
                        "engine replica %d down (%s); restart %d in %.0f s",
                        index,
                        slot.why,
                        len(recent) + 1,
                        slot.next_start - now,
                    )
        for g in retry:
            g.retried = True
            self._route(g)

    def _restart_pending(self) -> bool:
        return any(s.state in ("restarting", "starting") for s in self.slots)

    def _watch(self) -> None:
        sup = self.supervision
        while not self._stopping:
            time.sleep(MONITOR_INTERVAL)
            now = time.monotonic()
            for s in self.slots:
                c = s.replica
                if s.state == "serving" and c.alive:
                    quiet, busy = now - c.last_heard, c.busy_for
                    if quiet > sup.heartbeat_timeout or busy > sup.step_timeout:
                        c.error = f"engine replica {s.index} (pid {c.process.pid}) was hung: " + (
                            f"no heartbeat for {quiet:.1f} s"
                            if quiet > sup.heartbeat_timeout
                            else f"one step ran {busy:.0f} s"
                        )
                        log.error("%s; killing it", c.error)
                        c.kill()  # the reader sees EOF and reports the death (_replica_died)
                elif s.state == "restarting" and now >= s.next_start:
                    with self._lock:
                        s.restarts.append(now)
                        s.state = "starting"
                        s.client = self._spawn(s)
                elif s.state == "starting" and c.started:
                    self._started_again(s)
            self._expire_retries(now)

    def _started_again(self, s: _Slot) -> None:
        with self._lock:
            c = s.replica
            if not c.alive:
                return  # it failed to start: its death already scheduled the next try
            s.state = "serving"
            self._started_router().add(s.index)
            retry, self._retry = self._retry, []
        log.warning("engine replica %d serves again (pid %d)", s.index, c.process.pid)
        for _, g in retry:
            self._route(g)

    def _expire_retries(self, now: float) -> None:
        with self._lock:
            gone = [g for t, g in self._retry if t <= now or not self._restart_pending()]
            self._retry = [(t, g) for t, g in self._retry if t > now and self._restart_pending()]
        why = "no engine replica came back to serve this request"
        publish([(sink, Update([], "error", why, "server_error")) for g in gone for sink in g.sinks])

    # -- admin and observation ------------------------------------------------------------------
    def set_policy(self, config: RouterConfig) -> None:
        """Switch the routing policy (benchmarks); the prefix trees start empty."""
        with self._lock:
            router = self._started_router()
            router.config = config
            router.reset()

    def flush_cache(self, timeout: float = 60.0) -> int:
        """POST /flush_cache: every serving replica's cache (cache_admin.py) and the router's trees."""
        freed = sum(f.result(timeout) for f in self.call_all(flush_engine_cache))
        with self._lock:
            self._started_router().reset()
        return freed

    def replica_stats(self) -> list[Stats]:
        """Each replica's last Stats (a replica that is down: empty)."""
        return [s.client.stats if s.client is not None and s.client.alive else Stats() for s in self.slots]

    @property
    def stats(self) -> Stats:
        """The serving replicas' Stats, summed (the /metrics gauges)."""
        live = [s.client.stats for s in self.slots if s.client is not None and s.client.alive]
        if not live:
            return Stats()
        total = {
            f.name: _sum([getattr(s, f.name) for s in live]) for f in dataclasses.fields(Stats) if f.name != "time"
        }
        return Stats(**total)

    def collectors(self) -> list:
        return [ReplicaCollector(self)]

    def health(self) -> LoopHealth:
        rows = [self.replica_status(s) for s in self.slots]
        serving = sum(r["alive"] for r in rows)
        return LoopHealth(alive=serving > 0, replicas=rows, degraded=0 < serving < len(rows))

    def replica_status(self, s: _Slot) -> dict:
        r = s.replica
        out = {
            "index": s.index,
            "alive": s.state == "serving" and r.alive,
            "state": s.state,
            "restarts": len(s.restarts),
            "pid": r.process.pid,
            "in_flight": r.in_flight,
            "routed": self.router.routed[s.index] if self.router else 0,
            "finished": r.requests,
            "failed": r.failed,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "cache_hit_rate": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
        }
        if s.why or (not r.alive and r.error):
            out["error"] = s.why or r.error
        return out


def _sum(values: list) -> Any:
    """Replicas' values of one Stats field summed: numbers, or tuples of counts element by element."""
    if values and isinstance(values[0], tuple):
        width = max(map(len, values))
        return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
    return sum(values)


class ReplicaCollector:
    """Per-replica Prometheus gauges for /metrics (the engine gauges there are the replicas' sums)."""

    def __init__(self, pool: EnginePool):
        self.pool = pool

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        rows = [self.pool.replica_status(s) for s in self.pool.slots]
        for name, doc, key in (
            ("minisched_dp_replica_up", "1 while the replica process serves", "alive"),
            ("minisched_dp_replica_requests_in_flight", "requests routed there, not finished", "in_flight"),
            ("minisched_dp_replica_cache_hit_rate", "cached prompt tokens / prompt tokens", "cache_hit_rate"),
            ("minisched_dp_replica_restarts", "restarts of the replica's process", "restarts"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            for row in rows:
                g.add_metric([str(row["index"])], float(row[key]))
            yield g
