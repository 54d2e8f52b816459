"""The scheduler: request lifecycle over a paged KV pool and a radix cache (DESIGN.md §4).

Engine-facing API (pure Python; no torch):

    sched = Scheduler(SchedulerConfig(...), stop_checker=None)
    req = sched.add_request(rid, prompt_ids, SamplingParams(...))  # InvalidRequest on bad input
    while sched.has_work():
        batch = sched.get_next_batch()            # Batch | None
        if batch is None:                         # nothing to run this step, but requests may
            finished = sched.take_finished()     # have ended while it was built (see below)
        else:
            tokens = runner.forward(batch)        # one token per request, batch order
            finished = sched.process_batch_result(batch, tokens)
    # or simply: finished = sched.step(runner)    # the same loop body
    sched.abort(rid)                              # any state; False if unknown/done
    sched.fail_in_flight("why")                   # the forward/sampling of `batch` raised: end its
                                                  # requests with FinishReason.ERROR, release their KV
    sched.events, sched.step_stats, sched.check_invariants()

Overlap scheduling (overlap.py): `launch(batch)` right after `get_next_batch` advances the
state with placeholder tokens, the next `get_next_batch` may run while that batch computes,
and `resolve(batch, tokens)` applies its tokens one step late (oldest launched batch first);
`fail_launched("why")` ends every launched batch's requests.

`stop_checker(req) -> bool` is called after each new token (engine-side stop strings;
finish reason STOP_STR). Request ids must be unique among live requests.

Arrival: `max_new_tokens` is clipped so the request fits the context and the whole pool on
its own (`Req.max_new_tokens`; reaching the clip ends it with LENGTH), so no request can
wait for more pages than exist. `max_new_tokens=0` prefills the prompt into the cache and
ends with LENGTH and no tokens.

One step (`get_next_batch`): prefill first — the carried chunked request, then waiting
requests in policy order through the PrefillAdder (skipping, for one round, requests whose
uncached prefix another request in the batch is computing: deferral.py); with
`enable_mixed_chunk` the decode requests ride along and count against the chunk budget;
otherwise decode the running requests, retracting some first if their next pages do not
fit even after evicting the radix cache (retraction.py). At most
`max_prefill_rounds_between_decodes` prefill-only rounds run while requests wait to decode.
`process_batch_result` appends tokens, finishes requests and moves completed prefills into
the running (decode) batch.

Requests can also end inside `get_next_batch`, which then may return None: a lone running
request whose next page does not exist (only if pages leaked), or, after `max_stalled_steps`
steps with work but no batch, every request that is not running (FinishReason.ERROR with
`req.error`). They are returned by the next `process_batch_result`, or by `take_finished()`
when no batch was formed; `step()` does both, so callers never lose or spin on a request.

KV: after each prefill chunk a request's full pages are shared through the radix cache
(its `page_ids` then start with locked tree pages); when it finishes, aborts or is
retracted, its full pages stay in the cache (evictable) and the rest are freed. An
abort of a request in the batch in flight takes effect at `process_batch_result`.
`sched.reqs` maps rid -> live Req.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

from minisched.sched.batch import Batch, ForwardMode
from minisched.sched.config import SchedulerConfig
from minisched.sched.deferral import InBatchPrefixes
from minisched.sched.events import Event, StepStats
from minisched.sched.invariants import check_scheduler
from minisched.sched.kv_pool import KVPool
from minisched.sched import overlap
from minisched.sched.policy import SchedulePolicy
from minisched.sched.prefill_adder import AddResult, PrefillAdder
from minisched.sched.radix_cache import RadixCache
from minisched.sched.req import (FinishReason, InvalidRequest, Req, ReqStatus, SamplingParams, finish_reason,
                                  new_request)
from minisched.sched.retraction import fail_stalled, make_room_for_decode

__all__ = ["ModelRunner", "Scheduler", "SchedulerConfig"]


class ModelRunner(Protocol):
    def forward(self, batch: Batch) -> list[int]: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, stop_checker: Callable[[Req], bool] | None = None) -> None:
        self.config = config
        self.stop_checker = stop_checker
        self.pool = KVPool(config.num_pages, config.page_size)
        self.tree = RadixCache(config.page_size, disable=not config.enable_radix_cache)
        self.policy = SchedulePolicy(config.policy, self.tree, config.lpm_fallback_len, config.aging_rounds)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}  # live requests
        self.events: list[Event] = []
        self.step_stats: list[StepStats] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.step_count = 0
        self._ratio_decay = (config.init_new_token_ratio - config.min_new_token_ratio) / config.new_token_ratio_decay_steps
        self._prefill_rounds = 0  # prefill-only rounds since the last decode
        self._in_flight: Batch | None = None
        self._step_hits = 0
        self._num_arrivals = 0
        self._abort_pending: set[int] = set()  # id(req) of in-flight requests to abort
        self._stalled = 0  # consecutive steps with work but no batch
        self._finished_early: list[Req] = []  # finished inside get_next_batch (pool outgrown)
        self._launched: list[Batch] = []  # overlap: batches computing, tokens not applied yet (oldest first)
        self._limbo: list[Req] = []  # overlap: live, at their length limit, ending when their batch resolves
        self._next_future = 0  # overlap: placeholder token ids are -1, -2, ...

    # -- requests -------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: Sequence[int], sampling: SamplingParams | None = None) -> Req:
        cfg = self.config
        if isinstance(rid, str) and rid in self.reqs:
            raise InvalidRequest(f"request {rid!r}: duplicate request id")
        req = new_request(rid, prompt_ids, sampling, cfg.max_context_len, cfg.num_pages * cfg.page_size)
        req.arrival_seq = self._num_arrivals
        self._num_arrivals += 1
        self.reqs[rid] = req
        self.waiting.append(req)
        self._record(req, None, ReqStatus.WAITING)
        return req

    def abort(self, rid: str) -> bool:
        """Abort in any state; False if `rid` is unknown or already done. A request in the
        batch in flight is released when that batch's result arrives (its pages stay valid
        while the forward pass writes them)."""
        req = self.reqs.get(rid)
        if req is None:
            return False
        if self._in_flight is not None and any(r is req for r in self._in_flight.reqs):
            self._abort_pending.add(id(req))
            return True
        if self._launched:
            overlap.abort_launched(self, req)
            return True
        self._unlink(req)
        self._release(req, ReqStatus.ABORTED, FinishReason.ABORT)
        return True

    def fail_in_flight(self, message: str) -> list[Req]:
        """The batch in flight could not be computed (its forward, sampling or a stop checker
        raised). Its live requests end with FinishReason.ERROR and release their KV: their
        `kv_len` still counts only the tokens written by earlier steps, so only valid pages
        reach the radix cache; the pages allocated for this step are freed. Returns them."""
        batch, self._in_flight = self._in_flight, None
        self._abort_pending.clear()
        failed, self._finished_early = self._finished_early, []
        if batch is None:
            return failed
        for req in batch.reqs:
            if req.status not in (ReqStatus.RUNNING, ReqStatus.PREFILLING) or req.rid not in self.reqs:
                continue
            self._unlink(req)
            req.error = message
            self._release(req, ReqStatus.FINISHED, FinishReason.ERROR)
            failed.append(req)
        return failed

    def take_finished(self) -> list[Req]:
        """Requests that ended outside `process_batch_result` (failed with a step, or outgrew
        the pool while a batch was built) and were not reported yet; reported once."""
        done, self._finished_early = self._finished_early, []
        return done

    def _unlink(self, req: Req) -> None:
        if self._limbo and req in self._limbo:
            self._limbo.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req is self.chunked_req:
            self.chunked_req = None
        elif req.status is ReqStatus.RUNNING:
            self.running.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req is not None or self._limbo)

    # -- overlap scheduling (overlap.py) --------------------------------------
    def launch(self, batch: Batch) -> None:
        overlap.launch(self, batch)

    def resolve(self, batch: Batch, next_token_ids: Sequence[int]) -> list[Req]:
        return overlap.resolve(self, batch, next_token_ids)

    def fail_launched(self, message: str) -> list[Req]:
        return overlap.fail_launched(self, message)

    # -- one step -------------------------------------------------------------
    def step(self, runner: ModelRunner) -> list[Req]:
        """One step; if the runner raises, the batch's requests fail (see `fail_in_flight`) and
        the exception propagates with the scheduler ready for the next step."""
        batch = self.get_next_batch()
        if batch is None:
            return self.take_finished()
        try:
            tokens = runner.forward(batch)
        except BaseException as exc:  # KeyboardInterrupt included: never leave a batch in flight
            self._finished_early = self.fail_in_flight(f"{type(exc).__name__}: {exc}")
            raise
        return self.process_batch_result(batch, tokens)

    def get_next_batch(self) -> Batch | None:
        if self._in_flight is not None:
            raise RuntimeError("get_next_batch called before process_batch_result of the previous batch")
        self.step_count += 1
        k = self.config.max_prefill_rounds_between_decodes
        decode_due = bool(self.running) and k is not None and self._prefill_rounds >= k
        self._step_hits, n_retracted = 0, 0
        batch = None if decode_due else self._prefill_batch()
        if batch is not None and self.config.enable_mixed_chunk and self.running:
            batch = self._mix(batch)
        if batch is None and self.running and not (self._launched and not self._decode_fits()):
            # (with a batch launched, no retraction: its tokens are resolved first, see overlap.py)
            n_retracted = make_room_for_decode(self)
            if self.running:
                batch = self._decode_batch(n_retracted)
        if batch is None:
            self._stalled = self._stalled + 1 if self.has_work() and not self._launched else 0
            if self._stalled >= self.config.max_stalled_steps:
                fail_stalled(self)
            return None
        self._stalled = 0
        self._prefill_rounds = self._prefill_rounds + 1 if batch.mode is ForwardMode.PREFILL and self.running else 0
        self._in_flight = batch
        self._record_step(batch, n_retracted)
        return batch

    def process_batch_result(self, batch: Batch, next_token_ids: Sequence[int]) -> list[Req]:
        """Apply one step's sampled tokens (batch order); returns the requests that finished
        (including any finished while the batch was built, e.g. by outgrowing the pool)."""
        if batch is not self._in_flight:
            raise RuntimeError("process_batch_result: not the batch returned by the last get_next_batch")
        if len(next_token_ids) != len(batch.reqs):
            raise ValueError(f"expected {len(batch.reqs)} tokens, got {len(next_token_ids)}")
        finished, self._finished_early = self._finished_early, []
        try:
            self._apply_tokens(batch, next_token_ids, finished)
        except BaseException as exc:  # e.g. Ctrl-C in a stop checker: fail what was not applied yet
            self._finished_early = finished + self.fail_in_flight(f"{type(exc).__name__}: {exc}")
            raise
        self._in_flight = None
        return finished

    def _apply_tokens(self, batch: Batch, next_token_ids: Sequence[int], finished: list[Req]) -> None:
        running, prefilling = ReqStatus.RUNNING, ReqStatus.PREFILLING
        pending, max_ctx, checker = self._abort_pending, self.config.max_context_len, self.stop_checker
        for req, p, e, sampled, tok in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                           batch.sampled, next_token_ids):
            status = req.status
            if status is not running and status is not prefilling:
                continue
            req.kv_len = p + e
            if pending and id(req) in pending:
                self._unlink(req)
                self._release(req, ReqStatus.ABORTED, FinishReason.ABORT)
                continue
            if not sampled:  # a chunk that does not finish the prompt: the token is ignored
                self._cache_unfinished(req)
                continue
            if req.max_new_tokens == 0:  # prefill only: the prompt is now cached, no token is kept
                self._release(req, ReqStatus.FINISHED, FinishReason.LENGTH)
                finished.append(req)
                continue
            tok = int(tok)
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            sp = req.sampling
            if (len(req.output_ids) >= req.max_new_tokens or p + e + 1 >= max_ctx or checker is not None
                    or tok in sp.stop_token_ids):
                reason = finish_reason(req, max_ctx, checker)
                if reason is not None:
                    if status is running:
                        self.running.remove(req)
                    self._release(req, ReqStatus.FINISHED, reason)
                    finished.append(req)
                    continue
            if status is prefilling:
                self._cache_unfinished(req)
                self._set_status(req, running)
                self.running.append(req)
        pending.clear()

    # -- batch building -------------------------------------------------------
    def _prefill_batch(self) -> Batch | None:
        cfg = self.config
        if self.chunked_req is None and (not self.waiting or len(self.running) >= cfg.max_running_requests):
            return None
        defer = None
        if cfg.in_batch_prefix_defer_tokens is not None and not self.tree.disable:
            defer = InBatchPrefixes(cfg.page_size, cfg.in_batch_prefix_defer_tokens)
        mixed = len(self.running) if cfg.enable_mixed_chunk else 0  # decode rows riding along
        adder = PrefillAdder(self.pool, self.tree, self.new_token_ratio, cfg.max_prefill_tokens, cfg.chunk_size,
                             cfg.max_running_requests - len(self.running), self.running,
                             cfg.clip_max_new_tokens_estimation, mixed, defer)
        carried, self.chunked_req = self.chunked_req, None
        if carried is not None and not adder.add_chunked_req(carried):
            self.chunked_req = carried  # its pages do not fit yet: decode first
            return None
        if adder.new_chunked_req is None and self.waiting:
            admitted, aging = [], self.policy.active(len(self.waiting)) != "fcfs"
            for req in self.policy.order(self.waiting):
                result = adder.add_one_req(req)
                if adder.can_run and adder.can_run[-1] is req:
                    admitted.append(req)
                if result is not AddResult.CONTINUE and result is not AddResult.DEFERRED:
                    break
            if admitted:
                k = len(admitted)
                if all(a is w for a, w in zip(admitted, self.waiting[:k])):  # FCFS: a prefix
                    del self.waiting[:k]
                else:
                    ids = {id(r) for r in admitted}
                    self.waiting = [r for r in self.waiting if id(r) not in ids]
                if aging:  # count overtakes
                    newest = max(r.arrival_seq for r in admitted)
                    for r in self.waiting:
                        if r.arrival_seq < newest:
                            r.overtaken += 1
                now = time.monotonic()
                for req in admitted:
                    if req.first_scheduled_time is None:
                        req.first_scheduled_time = now
                    self._set_status(req, ReqStatus.PREFILLING)
        self.chunked_req = adder.new_chunked_req
        self._step_hits = adder.cache_hit_tokens
        if not adder.can_run:
            return None
        return Batch(ForwardMode.PREFILL, adder.can_run, adder.prefix_lens, adder.extend_lens, self.config.page_size)

    def _mix(self, batch: Batch) -> Batch:
        """Let the decode requests ride along with the prefill chunk if their pages fit."""
        need = self.pool.decode_pages_needed(self.running)
        if need > self.pool.num_free:
            self.pool.free(self.tree.evict(need - self.pool.num_free))
        if not self.pool.alloc_for_decode(self.running):
            return batch
        n = len(self.running)
        return Batch(ForwardMode.MIXED, batch.reqs + self.running, batch.prefix_lens + [r.kv_len for r in self.running],
                     batch.extend_lens + [1] * n, batch.page_size, batch.sampled + [True] * n, n)

    def _decode_batch(self, n_retracted: int) -> Batch:
        cfg = self.config
        if not n_retracted:  # (after a retraction _make_room_for_decode re-estimated it)
            self.new_token_ratio = max(cfg.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
        if not self.pool.alloc_for_decode(self.running):
            raise RuntimeError("decode pages do not fit after retraction")  # _make_room_for_decode ensures they do
        reqs = list(self.running)
        n = len(reqs)
        return Batch(ForwardMode.DECODE, reqs, [r.kv_len for r in reqs], [1] * n, cfg.page_size, [True] * n, n)

    def _decode_fits(self) -> bool:
        need = self.pool.decode_pages_needed(self.running)
        if need > self.pool.num_free:
            self.pool.free(self.tree.evict(need - self.pool.num_free))
        return need <= self.pool.num_free

    # -- KV release -----------------------------------------------------------
    def _retract(self, req: Req) -> None:
        self._free_kv(req)
        req.num_retractions += 1
        self._set_status(req, ReqStatus.RETRACTED)
        self._set_status(req, ReqStatus.WAITING)

    def _release(self, req: Req, status: ReqStatus, reason: FinishReason) -> None:
        """Finish or abort: KV into the radix cache, locks dropped, slot freed."""
        self._free_kv(req)
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self._set_status(req, status, reason.value)
        del self.reqs[req.rid]

    def _free_kv(self, req: Req) -> None:
        self.tree.cache_finished_req(req, self.pool)

    def _cache_unfinished(self, req: Req, kv_len: int | None = None) -> None:
        self.tree.cache_unfinished_req(req, self.pool, kv_len)

    # -- events and stats -----------------------------------------------------
    def _record(self, req: Req, src: ReqStatus | None, dst: ReqStatus, note: str = "") -> None:
        self.events.append(Event(time.monotonic(), self.step_count, req.rid, src, dst, req.prompt_len,
                                 len(req.output_ids), req.kv_len, req.cache_hit_tokens, note))

    def _set_status(self, req: Req, dst: ReqStatus, note: str = "") -> None:
        self._record(req, req.status, dst, note)
        req.status = dst

    def _record_step(self, batch: Batch, n_retracted: int) -> None:
        pool, tree = self.pool, self.tree
        decode = batch.num_decode
        self.step_stats.append(StepStats(
            self.step_count, time.monotonic(), batch.mode.value, batch.batch_size, batch.num_tokens - decode, decode,
            len(self.running), len(self.waiting), pool.num_free, tree.total_pages, tree.evictable_pages,
            1 - (pool.num_free + tree.evictable_pages) / pool.num_pages, self._step_hits, n_retracted,
            self.new_token_ratio))

    # -- invariants -----------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool, the radix cache and the queues agree
        (invariants.py). Call between steps (no batch in flight)."""
        check_scheduler(self)
