"""The engine on its own thread: the only code that touches the `Engine` once the server runs.

    loop = EngineLoop(engine); loop.start()
    loop.submit(rids, prompt_ids, sampling, sinks)  # from any thread; n = len(rids) choices, one Sink each
    loop.abort(rid)                                 # from any thread; idempotent
    loop.call(fn) -> concurrent.futures.Future      # fn(engine) run on the engine thread between steps
    loop.stop(); loop.join()                        # aborts what is left, ends the thread

Messages travel one way in and one way out:

- in: a FIFO inbox (`queue.SimpleQueue`) of add / abort / call / stop messages. The thread
  drains it before every step, blocks on it only when the engine has no work, and never
  waits for anything else -- not for HTTP, not for a client.
- out: after every step, each live request with new tokens or a finish gets one `Update`
  (new token ids, and on the last one the finish reason, the error and the radix-cache
  hit). All updates of a step go to each event loop in ONE `call_soon_threadsafe` call;
  the sink (`Sink.deliver`) runs there, so per-request state on the HTTP side is touched
  only by its event loop.

Anything a request can do -- an invalid add, an abort in any state, a failing step -- ends
that request with an `Update` and leaves the thread running. A request aborted here never
comes back from `engine.step()`, so the abort itself publishes its finish.

`static_batch=N` (benchmarks only) runs the seed's static-batching baseline: new requests
wait here until the engine is idle, then up to N of them start together.

Records: the scheduler keeps its events, step stats and journal until they are drained, every
HISTORY_LIMIT steps (GET /debug/requests/{id} reads what is kept). With a `recorder` (recorder.py,
`minisched serve --record`) the loop also hands it what is new since its last hand-over -- every
`recorder.interval` seconds and before each drain, between steps -- and the recorder writes it on its own
thread; `calls` tells it the client's id of each call it adds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from minisched.engine.structured import GRAMMAR_FAILED
from minisched.sched.req import ReqStatus
from minisched.sched.sampling_params import InvalidRequest, SamplingParams
from minisched.sched.snapshot import Records
from minisched.serve.cache_admin import flush_engine_cache
from minisched.serve.loop import LoopHealth, publish
from minisched.serve.messages import Sink, Stats, Update
from minisched.serve.recorder import Recorder

log = logging.getLogger("minisched.serve")
HISTORY_LIMIT = 4096  # steps of scheduler events / step stats kept (the server runs for days; the lists would grow)


class EngineLoop:
    def __init__(
        self,
        engine,
        *,
        check_invariants: bool = False,
        static_batch: Optional[int] = None,
        keep_history: bool = False,
        recorder: Optional[Recorder] = None,
    ):
        self.engine = engine
        self.recorder = recorder
        self._taken = Taken()  # how much of the records since the last drain the recorder has had
        self._recorded_at = time.monotonic()
        self.check = check_invariants
        self.static_batch = static_batch
        self.keep_history = keep_history
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = Stats()
        self.invariant_errors: list[str] = []
        self._live: dict[str, tuple[Any, Sink, int]] = {}  # rid -> (Req, sink, tokens published)
        self._held: collections.deque = collections.deque()  # static batching: (rids, ids, sampling, sinks)
        self._drained_at = 0  # the scheduler's step count at the last drain of its records
        self._step_errors = 0
        self._stopping = False
        self._stopped = False  # set by the engine thread as it ends
        self._step_started: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="minisched-engine", daemon=True)
        self._update_stats(step=False)  # /metrics from the start: the pool's and the host tier's sizes

    # -- any thread -----------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        rids: list[str],
        prompt_ids: list[int],
        sampling: SamplingParams,
        sinks: list[Sink],
        client_id: Optional[str] = None,
    ) -> None:
        self._send(("add", list(rids), prompt_ids, sampling, list(sinks), client_id))

    def _send(self, msg: tuple) -> None:
        self.inbox.put(msg)
        if self._stopped:
            self._answer_leftovers()

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between two steps (tests, admin)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, fut))
        return fut

    def call_all(self, fn: Callable[[Any], Any]) -> list[concurrent.futures.Future]:
        return [self.call(fn)]

    def stop(self) -> None:
        self.inbox.put(("stop",))

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    def health(self) -> LoopHealth:
        return LoopHealth(alive=self.is_alive(), failure=self.engine.health())

    def collectors(self) -> list:
        return []

    def replica_stats(self) -> list[Stats]:
        return [self.stats]

    def flush_cache(self, timeout: float = 60.0) -> int:
        return self.call(flush_engine_cache).result(timeout)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                self._handle_messages(block=not engine.has_work() and not self._held)
                if self._stopping:
                    self._abort_everything()
                    return
                self._admit_held()
                if not engine.has_work():
                    self._record()  # an idle server's last records reach the file too
                    continue
                self._step()
            except Exception:  # a bug here must not kill the server: log it and go on
                log.error("engine loop error:\n%s", traceback.format_exc())
                self._step_errors += 1
                time.sleep(0.01)

    def _handle_messages(self, block: bool) -> None:
        changed = False
        try:
            while True:
                try:
                    msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
                except queue.Empty:
                    return
                block = False
                changed |= msg[0] in ("add", "abort")
                if self._handle(msg):
                    return
        finally:
            if changed:  # an abort or an add between steps is a state change the next snapshot must show
                self._update_stats(step=False)

    def _handle(self, msg: tuple) -> bool:
        """One inbox message; True for "stop" (what comes after it is answered by _abort_everything)."""
        kind = msg[0]
        if kind == "add":
            if self.static_batch:
                self._held.append(msg[1:])
            else:
                self._add(*msg[1:])
        elif kind == "abort":
            self._abort(msg[1])
        elif kind == "call":
            _, fn, fut = msg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                    fut.set_exception(exc)
        elif kind == "stop":
            self._stopping = True
            return True
        return False

    def _add(
        self,
        rids: list[str],
        prompt_ids: list[int],
        sampling: SamplingParams,
        sinks: list[Sink],
        client_id: Optional[str] = None,
    ) -> None:
        try:
            reqs = self.engine.add_choices(prompt_ids, sampling, len(rids), rids=rids)
        except InvalidRequest as exc:
            publish([(sink, Update([], "error", str(exc), "invalid_request_error")) for sink in sinks])
        except Exception as exc:
            publish([(sink, Update([], "error", f"{type(exc).__name__}: {exc}", "server_error")) for sink in sinks])
        else:
            for rid, req, sink in zip(rids, reqs, sinks):
                self._live[rid] = (req, sink, -1)  # -1: nothing published yet
            if self.recorder is not None and client_id:
                self.recorder.calls(client_id, list(rids))

    def _abort(self, rid: str) -> None:
        for i, held in enumerate(self._held):
            if rid in held[0]:
                del self._held[i]
                publish([(sink, Update([], "abort")) for sink in held[3]])
                return
        entry = self._live.get(rid)
        if entry is None:  # finished already (its finish is on its way) or never added
            return
        self.engine.abort(rid)
        self._publish_progress()  # the abort is a finish the step will not report

    def _admit_held(self) -> None:
        batch = self.static_batch  # requests are held only when it is set
        if batch and self._held and not self.engine.has_work():
            for _ in range(min(batch, len(self._held))):
                self._add(*self._held.popleft())

    def _abort_everything(self) -> None:
        while self._held:
            publish([(sink, Update([], "abort")) for sink in self._held.popleft()[3]])
        for rid in list(self._live):
            self.engine.abort(rid)
        self._publish_progress()
        if self.recorder is not None:
            self._record(now=True)
            self.recorder.close()
        self._stopped = True
        self._answer_leftovers()

    def _answer_leftovers(self) -> None:
        """Messages that arrive after the stop are answered (an abort, an exception), never left
        hanging: by the engine thread as it ends, or by the sender once `_stopped` is set."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                publish([(sink, Update([], "abort")) for sink in msg[4]])
            elif msg[0] == "call" and msg[2].set_running_or_notify_cancel():
                msg[2].set_exception(RuntimeError("the engine loop has stopped"))

    def busy_for(self) -> float:
        """Seconds the current engine step has been running (0 between steps): the step watchdog's input."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def _step(self) -> None:
        engine = self.engine
        before = engine.last_error
        self._step_started = time.monotonic()
        try:
            engine.step()  # finished requests are found by their status below, whatever step() returned
        finally:
            self._step_started = None
            if engine.last_error is not before:  # a failed step (its requests got errors)
                self._step_errors += 1
            if self.check:
                try:
                    engine.scheduler.check_invariants()
                except AssertionError as exc:
                    self.invariant_errors.append(str(exc))
                    log.error("scheduler invariant broken: %s", exc)
            self._publish_progress()
            self._update_stats()

    def _publish_progress(self) -> None:
        """One Update per live request with new tokens or a finish; drop the finished ones."""
        out, done = [], []
        for rid, (req, sink, sent) in self._live.items():
            n = len(req.output_ids)
            finished = req.status in (ReqStatus.FINISHED, ReqStatus.ABORTED)
            if n == max(sent, 0) and not finished:
                continue
            start = max(sent, 0)
            upd = Update(req.output_ids[start:n])
            if req.output_logprobs is not None:
                upd.logprobs = req.output_logprobs[start:n]
            lead = req.after if req.after is not None else req  # n > 1: the prompt's shared prefill
            if sent < 0 and lead.prompt_logprobs is not None:
                upd.prompt_logprobs = list(lead.prompt_logprobs)
            if finished:
                upd.finish_reason = req.finish_reason.value if req.finish_reason else "error"
                upd.error = req.error
                upd.error_type = None if upd.finish_reason != "error" else _error_type(req.error)
                upd.cached_tokens = lead.cache_hit_tokens
                upd.num_retractions = req.num_retractions
                done.append(rid)
            else:
                self._live[rid] = (req, sink, n)
            out.append((sink, upd))
        for rid in done:
            del self._live[rid]
        publish(out)

    def _record(self, now: bool = False) -> None:
        """Hand the recorder the records new since its last hand-over (every `recorder.interval` seconds;
        `now`: at once). A copy of references, on the engine thread; the recorder writes them elsewhere."""
        if self.recorder is None or (not now and time.monotonic() - self._recorded_at < self.recorder.interval):
            return
        self._recorded_at = time.monotonic()
        recs, t = self.engine.scheduler.records(), self._taken
        new = Records(
            events=recs.events[t.events :],
            step_stats=recs.step_stats[t.step_stats :],
            journal=recs.journal[t.journal :],
        )
        if new.events or new.step_stats or new.journal:
            self._taken = Taken(len(recs.events), len(recs.step_stats), len(recs.journal))
            self.recorder.write(new)

    def _update_stats(self, step: bool = True) -> None:
        """A new Stats snapshot (after a step, or after adds / aborts handled between steps)."""
        sched = self.engine.scheduler
        snap = sched.snapshot()
        self._record()
        if not self.keep_history and snap.step - self._drained_at > HISTORY_LIMIT:
            self._record(now=True)  # what the drain drops goes to the recorder first
            sched.drain_records()
            self._taken = Taken()
            self.engine.step_times.clear()
            self._drained_at = snap.step
        host = snap.host
        spec, grammars = snap.spec, self.engine.grammars
        self.stats = Stats(
            steps=self.stats.steps + step,
            running=snap.running,
            waiting=snap.waiting + len(self._held),
            pages_total=snap.pages_total,
            pages_free=snap.pages_free,
            pages_cached=snap.pages_cached,
            pages_evictable=snap.pages_evictable,
            retractions=snap.retractions,
            step_errors=self._step_errors,
            host_pages_total=snap.host_pages_total,
            host_pages_used=snap.host_pages_used,
            host_loads=0 if host is None else host.loads,
            host_load_pages=0 if host is None else host.load_pages,
            host_hit_tokens=0 if host is None else host.host_hit_tokens,
            host_write_back_pages=0 if host is None else host.write_back_pages,
            host_write_backs=0 if host is None else host.write_backs,
            host_dropped_pages=0 if host is None else host.dropped_pages,
            preemptions=snap.preemptions,
            spec_draft_tokens=0 if spec is None else spec.draft_tokens,
            spec_accepted_tokens=0 if spec is None else spec.accepted_tokens,
            grammar_compiles=grammars.compiled,
            grammar_compile_timeouts=grammars.timeouts,
            grammar_compile_seconds=grammars.compile_seconds,
            grammar_compile_time_counts=tuple(grammars.compile_time_counts),
        )


@dataclass(frozen=True)
class Taken:
    """How many of the scheduler's records since its last drain the recorder has been handed."""

    events: int = 0
    step_stats: int = 0
    journal: int = 0


def _error_type(error: Optional[str]) -> str:
    """A grammar that does not compile (in time) is the request's fault: a 400; any other failure a 500."""
    return "invalid_request_error" if (error or "").startswith(GRAMMAR_FAILED) else "server_error"
