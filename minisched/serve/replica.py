"""One engine in its own process, and the server's handle on it: every `minisched serve` runs its
engine this way (`--dp N`: N of them; pool.py supervises them).

    client = ReplicaClient(0, functools.partial(Engine, "smollm2"))   # spawns the process
    info = client.wait_ready(timeout=300)          # EngineInfo: tokenizer, model and scheduler configs
    client.submit(Group(rids, prompt_ids, sampling, sinks))  # False: the replica is dead (route elsewhere)
    client.abort(rid); client.call(fn) -> Future   # fn(engine) on the replica's engine thread (picklable fn)
    client.kill(); client.stop(); client.join(timeout)

The replica process ('spawn' context, so no CUDA or thread state is inherited) builds its
Engine from a picklable zero-argument factory and runs the ordinary `EngineLoop`. Its main
thread reads the server's messages (add / abort / call / stop) from a `multiprocessing.Pipe`
(pickled: measured against pyzmq in RESULTS.md, "Serving") and hands them to the loop; the loop
publishes each step's updates -- every request's token deltas -- in ONE pipe message
(`_ForwardingLoop` stands in for the asyncio loop a `Sink` normally names); the main thread
sends a `Stats` snapshot whenever it changed (at most every STATS_INTERVAL seconds) and a
heartbeat every BEAT_INTERVAL with how long the current step has run (the pool's watchdog).

On the server side a reader thread per replica turns those messages back into `Update`s on
the requests' own event loops (`loop.publish`: one `call_soon_threadsafe` per batch) and
stamps `last_heard`. A replica that dies -- killed, crashed, out of memory, or killed by the
pool for going quiet -- closes its end of the pipe: the reader's `recv` raises EOFError at
once; every request of it that the client has seen something of ends with a `server_error`
update (HTTP 500, or an error event in the stream); the groups nothing was delivered for yet
go back to the pool (`on_death`), which routes them again, once. The replica in turn exits
when the server's end closes (the server died), and ignores SIGINT and SIGTERM: Ctrl-C in a
terminal (or `timeout`, or `kill -- -PGID`) signals the whole process group, and the server
must drain its requests before it stops the replicas.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, cast

from minisched.serve.engine_loop import EngineLoop
from minisched.serve.loop import publish
from minisched.serve.messages import Sink, Stats, Update

log = logging.getLogger("minisched.serve")
STATS_INTERVAL = 0.05  # seconds between the replica's Stats messages (only when they changed)
BEAT_INTERVAL = 0.5  # seconds between heartbeats (the supervisor's timeout is several of them)


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs from an engine it does not hold (ServerState reads these three)."""

    tokenizer: Any
    cfg: Any  # the model's ModelConfig (vocab_size)
    sched_config: Any  # the frozen SchedulerConfig (context length, pool size, page size)


class ReplicaStartError(RuntimeError):
    pass


@dataclass(eq=False)
class Group:
    """One submit: a prompt's choices (one request each). Kept until every choice has finished, so
    that a group nothing was delivered for yet can be retried elsewhere when its replica dies."""

    rids: list[str]
    prompt_ids: list[int]
    sampling: Any
    sinks: list
    client_id: Optional[str] = None  # the client's X-Request-Id (for the records)
    retried: bool = False
    delivered: bool = False  # some choice got tokens or a finish: the client saw it, no retry then


# -- the replica process -------------------------------------------------------------------------
class _Outbox:
    """The replica's end of the pipe, shared by its main thread and its engine thread."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        try:
            with self.lock:
                self.conn.send(msg)
        except (OSError, ValueError):  # the server is gone; the main thread notices on recv
            pass


class _ForwardingLoop:
    """What EngineLoop publishes to in a replica: a step's updates go to the server in one message."""

    def __init__(self, out: _Outbox):
        self.out = out

    def call_soon_threadsafe(self, _deliver, batch) -> None:
        self.out.send(("updates", [(sink.rid, upd) for sink, upd in batch]))


class _RemoteSink:
    __slots__ = ("rid", "loop")

    def __init__(self, rid: str, loop: _ForwardingLoop):
        self.rid, self.loop = rid, loop

    def deliver(self, update: Update) -> None:  # never called: _ForwardingLoop ships the batch instead
        raise AssertionError("a remote sink is delivered in the server process")


def _remote_sink(rid: str, loop: _ForwardingLoop) -> Sink:
    # publish() needs only the loop's call_soon_threadsafe (and a hashable loop), but Sink's
    # `loop` is typed as an asyncio loop (messages.py): the one place this stand-in is cast
    return cast(Sink, _RemoteSink(rid, loop))


def _replica_main(
    index: int,
    factory: Callable[[], Any],
    conn,
    cpus: Optional[list[int]],
    check_invariants: bool,
    recorder: Optional[Callable[[int], Any]] = None,
) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # group-wide signals are the server's: it drains, then stops us
        signal.signal(sig, signal.SIG_IGN)
    if cpus:  # before the engine: its default thread count is the cores this process may use
        os.sched_setaffinity(0, cpus)
    out = _Outbox(conn)
    try:
        engine = factory()
    except BaseException as exc:  # noqa: BLE001 -- reported to the server, which fails the start
        out.send(("failed", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        return
    try:  # this process's own series of record files (serve --record): a restart never continues an old one
        rec = None if recorder is None else recorder(index)
    except BaseException as exc:  # noqa: BLE001 -- reported to the server, which fails the start
        out.send(("failed", f"recording: {type(exc).__name__}: {exc}".splitlines()[0]))
        return
    loop = EngineLoop(engine, check_invariants=check_invariants, recorder=rec).start()
    fwd = _ForwardingLoop(out)
    out.send(("ready", EngineInfo(engine.tokenizer, engine.cfg, engine.sched_config)))
    sent_stats, beat = None, 0.0
    while True:
        try:
            ready = conn.poll(STATS_INTERVAL)
            msg = conn.recv() if ready else None
        except (EOFError, OSError):  # the server is gone
            break
        now = time.monotonic()
        if now - beat >= BEAT_INTERVAL:  # the server's supervisor kills a replica that goes quiet
            beat = now
            out.send(("beat", loop.busy_for()))
        if msg is not None:
            kind = msg[0]
            if kind == "add":
                _, rids, prompt_ids, sampling, client_id = msg
                loop.submit(rids, prompt_ids, sampling, [_remote_sink(rid, fwd) for rid in rids], client_id)
            elif kind == "abort":
                loop.abort(msg[1])
            elif kind == "call":
                _, token, fn = msg
                loop.call(fn).add_done_callback(functools.partial(_send_result, out, token))
            elif kind == "stop":
                break
        if loop.stats is not sent_stats:
            sent_stats = loop.stats
            out.send(("stats", sent_stats, len(loop.invariant_errors)))
    loop.stop()  # aborts what is left; the aborts go out as updates before the process ends
    loop.join(30)


def _outcome(fut: concurrent.futures.Future) -> tuple[bool, Any]:
    exc = fut.exception()
    if exc is None:
        return True, fut.result()
    return False, f"{type(exc).__name__}: {exc}"


def _send_result(out: _Outbox, token: int, fut: concurrent.futures.Future) -> None:
    out.send(("result", token, _outcome(fut)))


# -- the server side -----------------------------------------------------------------------------
class ReplicaClient:
    """The server process's handle on one replica. submit/abort/call from any thread."""

    def __init__(
        self,
        index: int,
        factory: Callable[[], Any],
        *,
        on_death: Optional[Callable[[int, bool, list[Group]], None]] = None,
        cpus: Optional[list[int]] = None,
        check_invariants: bool = False,
        recorder: Optional[Callable[[int], Any]] = None,
    ):
        ctx = multiprocessing.get_context("spawn")
        self.index, self.on_death = index, on_death
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_replica_main,
            args=(index, factory, child, cpus, check_invariants, recorder),
            name=f"minisched-replica-{index}",
            daemon=True,
        )
        self.process.start()
        child.close()  # only the replica holds its end now, so its death is EOF here
        self.info: Optional[EngineInfo] = None
        self.stats = Stats()
        self.invariant_errors = 0
        self.alive = False
        self.error: Optional[str] = None  # why it failed to start or died
        self.requests = self.prompt_tokens = self.cached_tokens = self.failed = 0
        self._lock = threading.Lock()  # guards _live, alive, the counters
        self._send_lock = threading.Lock()  # never taken by the reader: no cycle with a full pipe
        self._live: dict[str, tuple[Group, Any]] = {}  # rid -> (its group, its sink), until it finished
        self.last_heard = time.monotonic()  # any message from the replica (heartbeats every BEAT_INTERVAL)
        self.busy_for = 0.0  # the replica's current step has been running this long (its last heartbeat)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._stopping = False
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"minisched-replica-{index}-reader", daemon=True)
        self._reader.start()

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def wait_ready(self, timeout: float) -> EngineInfo:
        if not self._ready.wait(timeout):
            raise ReplicaStartError(f"engine replica {self.index} did not start within {timeout:.0f} s")
        if self.info is None:
            raise ReplicaStartError(f"engine replica {self.index} failed to start: {self.error}")
        return self.info

    def submit(self, group: Group) -> bool:
        with self._lock:
            if not self.alive:
                return False
            for rid, sink in zip(group.rids, group.sinks):
                self._live[rid] = (group, sink)
        if self._send(("add", list(group.rids), group.prompt_ids, group.sampling, group.client_id)):
            return True
        with self._lock:  # the replica is going; unless its death already took the group, route it again
            return all(self._live.pop(rid, None) is None for rid in group.rids)

    def has(self, rid: str) -> bool:
        return rid in self._live

    def live_rids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    @property
    def started(self) -> bool:
        """It has said "ready" or "failed", or died."""
        return self._ready.is_set()

    def kill(self) -> None:
        """SIGKILL (also ends a process stopped by SIGSTOP); the reader then sees EOF."""
        if self.process.is_alive():
            self.process.kill()

    def abort(self, rid: str) -> None:
        if self.alive:
            self._send(("abort", rid))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run the picklable `fn(engine)` on the replica's engine thread; the Future holds its result
        (an exception's one-line description becomes a RuntimeError)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            self._calls[token] = fut
            alive = self.alive
        if not alive or not self._send(("call", token, fn)):
            with self._lock:
                self._calls.pop(token, None)
            fut.set_exception(RuntimeError(f"engine replica {self.index} is not running"))
        return fut

    def stop(self) -> None:
        self._stopping = True
        self._send(("stop",))

    def join(self, timeout: float) -> None:
        """Wait for the process; kill one that outlives `timeout` (it ignores SIGTERM)."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._reader.join(5)
        self._conn.close()

    def _send(self, msg) -> bool:
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):  # broken pipe / closed: the reader will see EOF
            return False

    # -- the reader thread ----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # an unpicklable message: a bug, not a dead replica; keep reading
                log.error("replica %d sent a bad message:\n%s", self.index, traceback.format_exc())
                continue
            self.last_heard = time.monotonic()
            kind = msg[0]
            if kind == "beat":
                self.busy_for = msg[1]
            elif kind == "updates":
                self._deliver(msg[1])
            elif kind == "stats":
                self.stats, self.invariant_errors = msg[1], msg[2]
            elif kind == "result":
                with self._lock:
                    fut = self._calls.pop(msg[1], None)
                if fut is not None:
                    ok, value = msg[2]
                    fut.set_result(value) if ok else fut.set_exception(RuntimeError(value))
            elif kind == "ready":
                self.info, self.alive = msg[1], True
                self._ready.set()
            elif kind == "failed":
                self.error = msg[1]
        self._died()

    def _deliver(self, items: list[tuple[str, Update]]) -> None:
        out = []
        with self._lock:
            for rid, upd in items:
                entry = self._live.get(rid)
                if entry is None:
                    continue
                group, sink = entry
                if upd.token_ids or upd.finish_reason is not None:
                    group.delivered = True
                if upd.finish_reason is not None:
                    del self._live[rid]
                    self.requests += 1
                    self.prompt_tokens += len(group.prompt_ids)
                    self.cached_tokens += upd.cached_tokens
                out.append((sink, upd))
        publish(out)

    def _died(self) -> None:
        self.process.join(2)  # EOF comes as the process exits; its status follows shortly
        code = self.process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        with self._lock:
            was_alive, self.alive = self.alive, False
            pending, self._live = self._live, {}
            calls, self._calls = self._calls, {}
        if self.error is None:
            self.error = f"engine replica {self.index} {how}"
        groups = list({id(g): g for g, _ in pending.values()}.values())
        # a group nothing was delivered for may run again elsewhere, once; the others fail now
        retry = [g for g in groups if not g.delivered and not g.retried and not self._stopping]
        again = {id(g) for g in retry}
        failing = [(sink, rid) for rid, (g, sink) in pending.items() if id(g) not in again]
        self.failed += len(failing)
        if not (self._stopping or not was_alive):
            log.error(
                "%s; %d request(s) in flight there failed, %d not started yet to be retried",
                self.error,
                len(failing),
                sum(len(g.rids) for g in retry),
            )
        upd = (
            (lambda: Update([], "abort"))
            if self._stopping
            else (lambda: Update([], "error", self.error, "server_error"))
        )
        publish([(sink, upd()) for sink, _ in failing])
        for fut in calls.values():
            fut.set_exception(RuntimeError(self.error))
        self._ready.set()
        if self.on_death is not None and not self._stopping:
            self.on_death(self.index, was_alive, retry)  # the pool: restart, and route the retries again
        else:
            publish([(sink, upd()) for g in retry for sink in g.sinks])
