"""The scheduler: request lifecycle over a paged KV pool and a radix cache (docs/lifecycle.md).

Engine-facing API (pure Python; no torch):

    sched = Scheduler(SchedulerConfig(...), stop_checker=None)
    req = sched.add_request(rid, prompt_ids, SamplingParams(...))  # InvalidRequest on bad input
    while sched.has_work():
        batch = sched.get_next_batch()            # Batch | None
        if batch is None:                         # nothing to run this step, but requests may
            finished = sched.take_finished()     # have ended while it was built (see below)
        else:
            tokens = runner.forward(batch)        # one token per request, batch order (or a StepOutput)
            finished = sched.process_batch_result(batch, tokens)
    # or simply: finished = sched.step(runner)    # the same loop body
    sched.abort(rid)                              # any state; False if unknown/done
    sched.fail_in_flight("why")                   # the step raised: end the requests of every
                                                  # built or launched batch with FinishReason.ERROR
    sched.snapshot()                              # gauges and counters (snapshot.py)
    sched.records(), sched.drain_records()        # events and step stats: copies, or handed over
    sched.flush_cache()                           # empty the radix cache (device and host tier)
    sched.get(rid), sched.check_invariants()

Everything else (the queues, the pool, the tree) is the scheduler's own: collaborators in sched/
see it through the `Queues` protocol (queues.py), nothing outside sched/ reads it
(tests/test_layers.py checks that).

One way through a step, overlapped or not (in_flight.py): a built batch is *launched* --
`launch(batch)` advances the state as if its sampled tokens were known (each row's `kv_len`
becomes prefix + extend; each sampled row gets a placeholder token, a negative "future id",
in `req.pending_ids`; a completed prompt joins `running`; a request whose placeholder reaches
its length limit is held back in `limbo`, so it is never scheduled past its end) -- and then
*resolved*: `resolve(batch, tokens)` replaces the placeholders by the sampled tokens, runs the
finish checks and releases what ended. `process_batch_result` is launch-then-resolve at once;
overlap scheduling (engine/overlap.py) builds step N+1 between the two calls of step N. A
request found finished at resolve may already sit in the next launched batch: that token is
dropped and the request gives back its KV as of the resolved steps (`InFlight.committed_len`),
so the pool and the radix cache end exactly as without overlap. Rules that keep every page
valid even if a launched step fails: the radix cache only learns pages written by resolved
steps; no retraction while a batch is launched (`get_next_batch` waits for it instead); an
abort releases at once with the committed length (a row of a built, unlaunched batch is
released when that batch resolves, with the K/V its forward wrote). Pages freed under a
running forward are only handed to later steps, whose forwards run after it.

`stop_checker(req) -> bool` is called after each new token (engine-side stop strings;
finish reason STOP_STR). Request ids must be unique among live requests.

Arrival: `max_new_tokens` is clipped so the request fits the context and the whole pool on
its own (`Req.max_new_tokens`; reaching the clip ends it with LENGTH), so no request can
wait for more pages than exist. `max_new_tokens=0` prefills the prompt into the cache and
ends with LENGTH and no tokens.

Building a batch (`get_next_batch`, batch_builder.py): prefill first -- the carried chunked
request, then waiting requests in policy order through the PrefillAdder; with
`enable_mixed_chunk` the decode requests ride along; otherwise decode the running requests,
retracting some first if their next pages do not fit even after evicting the radix cache
(retraction.py). At most `max_prefill_rounds_between_decodes` prefill-only rounds run while
requests wait to decode.

Requests can also end inside `get_next_batch`, which then may return None: a lone running
request whose next page does not exist (only if pages leaked), or, after `max_stalled_steps`
steps with work but no batch, every request that is not running. They are returned by the
next resolve, or by `take_finished()` when no batch was formed; `step()` does both.

KV: after each prefill chunk a request's full pages are shared through the radix cache; when
it finishes, aborts or is retracted, its full pages stay in the cache (evictable) and the rest
are freed. `sched.reqs` maps rid -> live Req.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from minisched.base.values import cdiv
from minisched.sched import batch_builder
from minisched.sched.batch import Batch, ForwardMode
from minisched.sched.config import SchedulerConfig
from minisched.sched.decisions import StepWhy
from minisched.sched.events import Event, StepStats
from minisched.sched.forks import ForkPages
from minisched.sched.host_tier import HostTier
from minisched.sched.in_flight import InFlight
from minisched.sched.invariants import check_scheduler
from minisched.sched.journal import Journal
from minisched.sched.kv_pool import KVPool
from minisched.sched.policy import SchedulePolicy, take_admitted
from minisched.sched.radix_cache import RadixCache
from minisched.sched.req import FinishReason, Place, Req, ReqStatus, finish_reason, new_request
from minisched.sched.retraction import fail_stalled
from minisched.sched.sampling_params import InvalidRequest, SamplingParams
from minisched.sched.snapshot import CacheFlush, Records, SchedulerSnapshot
from minisched.sched.spec import Drafter, Speculator
from minisched.sched.step_output import StepOutput

__all__ = ["ModelRunner", "Scheduler", "SchedulerConfig"]

LIVE = (ReqStatus.RUNNING, ReqStatus.PREFILLING)


class ModelRunner(Protocol):
    def forward(self, batch: Batch) -> Sequence[int] | StepOutput:
        """One token per row of `batch`, in batch order (a StepOutput also carries log-probabilities)."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        stop_checker: Callable[[Req], bool] | None = None,
        host_tier: HostTier | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        if config.num_pages is None or config.max_context_len is None:
            raise ValueError("Scheduler: num_pages and max_context_len must be set (the engine sizes them)")
        self.config = config
        self.max_context_len: int = config.max_context_len  # (set: checked above)
        self._stop_checker = stop_checker
        self.stop_checker = None if stop_checker is None else self._checked_stop
        host = None if host_tier is None else (host_tier.capacity, host_tier.write_through)
        self.journal = Journal(config, host, drafter is not None)  # inputs and decisions, for replay (journal.py)
        self.why = StepWhy(0)  # the decisions of the batch being built (decisions.py)
        self.pool = KVPool(config.num_pages, config.page_size)
        self.forks = ForkPages(self.pool, enabled=config.enable_radix_cache)
        self.tree = RadixCache(
            config.page_size,
            disable=not config.enable_radix_cache,
            host=host_tier,
            touch_split_tail=config.lru_rule == "sglang",
        )
        self.policy = SchedulePolicy(
            config.policy,
            self.tree,
            config.lpm_fallback_len,
            config.aging_rounds,
            dfs_weight_fallback=config.dfs_weight_fallback,
            dfs_ties_reversed=config.dfs_ties_reversed,
            sglang_sort=config.policy_sort == "sglang",
            deprioritize_tokens=config.in_batch_prefix_defer_tokens
            if config.in_batch_prefix_rule == "sglang"
            else None,
        )
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}  # live requests
        self.in_flight = InFlight()
        self.events: list[Event] = []
        self.step_stats: list[StepStats] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.step_count = 0
        self.prefill_rounds = 0  # prefill-only rounds since the last decode
        self.stalled = 0  # consecutive steps with work but no batch
        # pause_admission_when_full (SGLang's batch_is_full): no prefill is tried until a running request leaves
        self.batch_is_full = False
        self.last_batch: Batch | None = None  # the batch built by the previous get_next_batch
        self.num_retracted = 0  # requests retracted for decode room so far (the step stats' sum)
        self.num_preempted = 0  # requests retracted for a more urgent one so far (preemption.py)
        self._finished_early: list[Req] = []  # ended outside resolve, not reported yet
        self.unrun_loads: list = []  # host-tier loads of failed batches (fail_in_flight): the engine runs them
        self.speculator = (  # speculative decoding (spec.py): drafts verified in VERIFY batches
            None
            if drafter is None
            else Speculator(
                drafter,
                config.num_draft_tokens,
                config.spec_max_batch_size,
                config.spec_adaptive,
                cost_model=config.spec_cost_model,
            )
        )
        self._num_arrivals = 0
        self._closed_gates: list[Req] = []  # waiting requests whose gate has not opened yet

    # -- requests -------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        after: Req | None = None,
        gate: Any = None,
        arrival_time: float | None = None,
    ) -> Req:
        """`after`: a request this one waits for (n > 1: the prefill of the shared prompt); `gate`: a
        future it waits for (a compiling grammar), holding no slot or page meanwhile; `arrival_time`
        (time.monotonic()): when it arrived, if before now (a replayed workload's scheduled arrival),
        for its latencies and its arrival event."""
        cfg = self.config
        if isinstance(rid, str) and rid in self.reqs:
            raise InvalidRequest(f"request {rid!r}: duplicate request id")
        req = new_request(rid, prompt_ids, sampling, self.max_context_len, self.pool.num_pages * cfg.page_size)
        if req.sampling.priority != 0 and not cfg.priority_scheduling:
            raise InvalidRequest(
                f"request {rid!r}: priority {req.sampling.priority} given but priority scheduling is not enabled"
            )
        req.after, req.gate = after, gate
        if gate is not None:
            self._closed_gates.append(req)
        if after is not None:
            after.forks += 1
        req.arrival_seq, req.arrival_step = self._num_arrivals, self.step_count
        self._num_arrivals += 1
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.journal.add(
            rid, req.prompt_ids, req.sampling, None if after is None else after.rid, gate is not None, req.arrival_time
        )
        self.reqs[rid] = req
        self._put(req, Place.WAITING)
        self.record(req, None, ReqStatus.WAITING, at=req.arrival_time)  # the journal's arrival time too
        return req

    def abort(self, rid: str) -> bool:
        """Abort in any state; False if `rid` is unknown or already done. A row of the built,
        unlaunched batch is released when that batch resolves (its forward may be writing its
        pages); anywhere else the request is released now, with its committed KV."""
        req = self.reqs.get(rid)
        if req is None:
            return False
        self.journal.append({"op": "abort", "rid": rid, "t": time.monotonic()})
        if self.in_flight.in_built(req):
            self.in_flight.aborted.add(id(req))
        else:
            self.end(req, self.in_flight.committed_len(req), ReqStatus.ABORTED, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req is not None or self.in_flight.limbo)

    def take_finished(self) -> list[Req]:
        """Requests that ended outside resolve (failed with a step, or outgrew the pool while a
        batch was built) and were not reported yet; reported once."""
        done, self._finished_early = self._finished_early, []
        return done

    def finished_early(self, req: Req) -> None:
        """`req` ended outside resolve: report it with the next finished list."""
        self._finished_early.append(req)

    def get(self, rid: str) -> Req | None:
        """The live request `rid`, or None (unknown or ended)."""
        return self.reqs.get(rid)

    def gated_requests(self) -> list[Req]:
        """The waiting requests held by a gate (a compiling grammar), in queue order."""
        return [r for r in self.waiting if r.gate is not None]

    def only_gated_work(self) -> list:
        """The gates (futures) of the waiting requests when every queued request waits for one and nothing
        runs, so the caller may wait for a gate instead of spinning; else []."""
        pending = [r.gate for r in self.waiting if not r.ready and r.gate is not None and not r.gate.done()]
        if pending and len(pending) == len(self.waiting) and not self.running and self.chunked_req is None:
            return pending
        return []

    def take_unrun_loads(self) -> list:
        """The host-tier loads of batches that failed (`fail_in_flight`), handed over once: the caller runs
        them (a copy, harmless if they had run), so that their nodes' device pages hold their K/V."""
        loads, self.unrun_loads = self.unrun_loads, []
        return loads

    def snapshot(self) -> SchedulerSnapshot:
        """Gauges and counters now (between steps)."""
        pool, tree, host = self.pool, self.tree, self.tree.host
        spec = self.speculator
        return SchedulerSnapshot(
            step=self.step_count,
            running=len(self.running),
            waiting=len(self.waiting) + (self.chunked_req is not None),
            live=len(self.reqs),
            pages_total=pool.num_pages,
            pages_free=pool.num_free,
            pages_cached=tree.total_pages,
            pages_evictable=tree.evictable_pages,
            new_token_ratio=self.new_token_ratio,
            retractions=self.num_retracted,
            preemptions=self.num_preempted,
            host_pages_total=0 if host is None else host.capacity,
            host_pages_used=0 if host is None else host.used,
            host=None if host is None else dataclasses.replace(host.stats),
            spec=None if spec is None else dataclasses.replace(spec.stats),
        )

    def records(self) -> Records:
        """The events, step stats and journal entries recorded since the last `drain_records` (copies)."""
        return Records(
            events=tuple(self.events), step_stats=tuple(self.step_stats), journal=tuple(self.journal.entries)
        )

    def drain_records(self) -> Records:
        """The events, step stats and journal recorded since the last drain, handed over: the scheduler
        keeps none of them (a server running for days drains them to bound its memory)."""
        out = self.records()
        self.events.clear()
        self.step_stats.clear()
        self.journal.drain()
        return out

    def flush_cache(self) -> CacheFlush:
        """Empty the radix cache: every page no live request locks goes, on the device (back to the
        pool) and on the host tier (dropped, not written back). Requests keep what they hold."""
        self.journal.append({"op": "flush"})
        pages, host_pages = self.tree.flush()
        self.pool.free(pages)
        return CacheFlush(device_pages=len(pages), host_pages=host_pages)

    def fail_waiting(self, req: Req, message: str) -> None:
        """End a waiting request with FinishReason.ERROR (its grammar failed to compile)."""
        self.journal.append({"op": "fail_waiting", "rid": req.rid, "message": message})
        req.error = message
        self.end(req, 0, ReqStatus.FINISHED, FinishReason.ERROR)
        self.finished_early(req)

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
            self.fail_in_flight(f"{type(exc).__name__}: {exc}")
            raise
        return self.process_batch_result(batch, tokens)

    def get_next_batch(self) -> Batch | None:
        if self.in_flight.built is not None:
            raise RuntimeError("get_next_batch called before the previous batch was launched (or process_batch_result)")
        self.step_count += 1
        self.why = why = StepWhy(self.step_count)
        opened = self._open_gates()
        evicted = self.tree.evicted_pages
        batch, n_retracted, hits = batch_builder.build(self)
        why.evicted = self.tree.evicted_pages - evicted
        self.journal.build(self.step_count, batch, why, opened)
        self.last_batch = batch
        if batch is None:
            gated = any(not r.ready for r in self.waiting)  # waiting for a grammar or a prefill: not stuck
            self.stalled = self.stalled + 1 if self.has_work() and not self.in_flight.launched and not gated else 0
            if self.stalled >= self.config.max_stalled_steps:
                fail_stalled(self)
            return None
        self.stalled = 0
        self.prefill_rounds = self.prefill_rounds + 1 if batch.mode is ForwardMode.PREFILL and self.running else 0
        self.in_flight.built = batch
        self._record_step(batch, n_retracted, hits)
        return batch

    def process_batch_result(self, batch: Batch, next_token_ids: Sequence[int] | StepOutput) -> list[Req]:
        """Apply the sampled tokens (batch order) of the batch from the last `get_next_batch`:
        launch and resolve at once. Returns the requests that finished (with any that ended
        while the batch was built)."""
        if batch is self.in_flight.built and len(next_token_ids) != len(batch.reqs):
            raise ValueError(f"expected {len(batch.reqs)} tokens, got {len(next_token_ids)}")
        self.launch(batch)
        return self.resolve(batch, next_token_ids)

    def launch(self, batch: Batch) -> None:
        """The batch from the last `get_next_batch` goes to the forward: advance the state with
        placeholder tokens for its sampled rows."""
        flight = self.in_flight
        if batch is not flight.built:
            raise RuntimeError("launch: not the batch returned by the last get_next_batch")
        flight.built = None
        flight.launched.append(batch)
        self.journal.append({"op": "launch", "t": time.monotonic()})
        max_ctx, futures = self.max_context_len, []
        verify = batch.mode is ForwardMode.VERIFY
        for req, p, e, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sampled):
            req.kv_len = p + e
            if not sampled:  # a chunk that does not finish its prompt: it stays the carried request
                futures.append(0)
                continue
            fid = flight.next_future()
            futures.append(fid)
            if verify:  # a placeholder per token it may accept; never in limbo (resolved before the next build)
                more = [flight.next_future() for _ in range(e - 1)]
                req.pending_ids += [fid, *more]
                batch.draft_futures += more
                continue
            if req.max_new_tokens == 0:  # prefill only: ends at resolve, without a token
                self._put(req, Place.LIMBO)
                continue
            req.pending_ids.append(fid)
            done = len(req.output_ids) + len(req.pending_ids) >= req.max_new_tokens or p + e + 1 >= max_ctx
            if req.status is ReqStatus.PREFILLING:
                self._set_status(req, ReqStatus.RUNNING)
                self._put(req, Place.LIMBO if done else Place.RUNNING)
            elif done:
                self._put(req, Place.LIMBO)
        batch.future_ids = futures

    def resolve(self, batch: Batch, next_token_ids: Sequence[int] | StepOutput) -> list[Req]:
        """The oldest launched batch's sampled tokens (batch order; a StepOutput also carries the
        log-probabilities its rows asked for) arrived: apply them; returns the requests that
        finished (and any that ended early)."""
        flight = self.in_flight
        if not flight.launched or batch is not flight.launched[0]:
            raise RuntimeError("resolve: not the oldest launched batch")
        if len(next_token_ids) != len(batch.reqs):
            raise ValueError(f"expected {len(batch.reqs)} tokens, got {len(next_token_ids)}")
        out = next_token_ids
        more = out.more_tokens if isinstance(out, StepOutput) else None
        tokens = out.tokens if isinstance(out, StepOutput) else out
        spec = self.speculator
        learns = spec is not None and spec.cost is not None  # only the cost model reads timings: journal them for it
        seconds = (
            out.seconds if learns and isinstance(out, StepOutput) and batch.num_decode == batch.batch_size else None
        )
        entry = self.journal.resolve(
            [int(t) for t in tokens], None if more is None else [[int(t) for t in m] for m in more], seconds
        )
        if seconds is not None and spec is not None:  # a decode or verify step's cost (spec_cost.py)
            spec.observe_step(batch.num_tokens, seconds, batch.mode is ForwardMode.VERIFY)
        finished, self._finished_early = self._finished_early, []
        try:
            self._apply(batch, next_token_ids, finished)
        except BaseException as exc:  # e.g. Ctrl-C in a stop checker: fail what was not applied
            self.fail_in_flight(f"{type(exc).__name__}: {exc}")
            self._finished_early[:0] = finished
            raise
        flight.launched.pop(0)
        self.pool.free(batch.free_after)  # pages its copies read from (forks.py): free once it has run
        if not self.has_work():
            entry["idle"] = True
        return finished

    def _apply(self, batch: Batch, out: Sequence[int] | StepOutput, finished: list[Req]) -> None:
        first_decode = batch.batch_size - batch.num_decode
        aborted = self.in_flight.aborted
        tokens, lps, prompt_lps, more, more_lps = (
            (out.tokens, out.logprobs, out.prompt_logprobs, out.more_tokens, out.more_logprobs)
            if isinstance(out, StepOutput)
            else (out, None, None, None, None)
        )
        drafts: Sequence[Sequence[int]] = batch.drafts or [()] * batch.batch_size
        spec = self.speculator
        if batch.mode is ForwardMode.VERIFY:
            assert spec is not None, "a VERIFY batch without a speculator"
            spec.stats.verify_steps += 1
        for b, (req, p, e, sampled, fid, tok, d) in enumerate(
            zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sampled, batch.future_ids, tokens, drafts)
        ):
            if req.status not in LIVE:
                continue  # released while launched (abort, or finished by an earlier resolve): dropped
            valid = p + e - len(d)  # K/V known good: a verify row's drafts are not, until accepted
            if aborted and id(req) in aborted:
                self.end(req, valid, ReqStatus.ABORTED, FinishReason.ABORT)
                continue
            if prompt_lps is not None and prompt_lps[b] and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend(prompt_lps[b])
            if not sampled:
                self.cache_unfinished(req, valid)
                continue
            if req.max_new_tokens == 0:
                self.end(req, valid, ReqStatus.FINISHED, FinishReason.LENGTH)
                finished.append(req)
                continue
            if not req.pending_ids or req.pending_ids[0] != fid:
                raise RuntimeError(f"{req.rid}: placeholder {fid} is not the oldest pending token")
            run, run_lps = [int(tok)], [lps[b] if lps is not None else None]
            if d:  # a verify row: the accepted drafts' tokens and the target's next one
                assert more is not None and spec is not None, "a verify row without its accepted tokens"
                run += [int(t) for t in more[b]]
                row_lps = more_lps[b] if more_lps is not None else None
                run_lps += row_lps if row_lps else [None] * len(more[b])
                if len(run) > len(d) + 1:
                    raise RuntimeError(f"{req.rid}: {len(run)} tokens accepted from {len(d)} drafts")
                spec.observe(req, len(d), len(run) - 1)
            del req.pending_ids[: 1 + len(d)]
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if self._append(req, run, valid, run_lps, finished):
                continue
            if d:  # the pages past the accepted tokens go back
                req.kv_len = valid + len(run) - 1
                keep = cdiv(req.kv_len, self.config.page_size)
                self.pool.free(req.page_ids[keep:])
                del req.page_ids[keep:]
            if not req.pending_ids and req.place is Place.LIMBO:
                raise RuntimeError(f"{req.rid}: held back at its length limit but not finished")
            if b < first_decode:  # its prompt completed in this batch: share its pages
                self.cache_unfinished(req, valid)

    def _append(self, req: Req, run: list[int], valid: int, logprobs: list, finished: list[Req]) -> bool:
        """Append a row's tokens (and their logprobs) one at a time, checking after each whether the
        request ends (with the K/V of the tokens before it: `valid` for the first); True if it ended."""
        checker, max_ctx = self.stop_checker, self.max_context_len
        for i, tok in enumerate(run):
            req.output_ids.append(tok)
            if req.output_logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            if (
                len(req.output_ids) >= req.max_new_tokens
                or valid + i + 1 >= max_ctx
                or checker is not None
                or tok in req.sampling.stop_token_ids
            ):
                reason = finish_reason(req, max_ctx, checker)
                if reason is not None:
                    self.end(req, valid + i, ReqStatus.FINISHED, reason)
                    finished.append(req)
                    return True
        return False

    def fail_in_flight(self, message: str) -> list[Req]:
        """A step failed (its forward, sampling or a stop checker raised, or the loop was
        interrupted): every live request of every launched batch, and of the built one, ends
        with FinishReason.ERROR and gives back its KV as of the resolved steps. With overlap
        the caller lets the worker finish what it runs first (its results are dropped).
        Returns the failed requests, also reported by `take_finished()`."""
        self.journal.append({"op": "fail", "message": message})
        batches = self.in_flight.take_all()
        # their host-tier loads may not have run: the caller runs them again (a copy, so harmless if they had)
        self.unrun_loads += [load for b in batches for load in b.loads]
        for b in batches:
            self.pool.free(b.free_after)
        valid: dict[int, int] = {}
        for batch in batches:
            for r, p in zip(batch.reqs, batch.prefix_lens):
                valid.setdefault(id(r), p)
        failed = self.take_finished()
        for batch in batches:
            for req in batch.reqs:
                if req.status in LIVE and self.reqs.get(req.rid) is req:
                    req.error = message
                    self.end(req, valid[id(req)], ReqStatus.FINISHED, FinishReason.ERROR)
                    failed.append(req)
        self._finished_early = failed
        return list(failed)

    def _open_gates(self) -> list[str]:
        """Open the gates that are done (a compiled grammar) now, once per build; their request ids."""
        if not self._closed_gates:
            return []
        opened, closed = [], []
        for r in self._closed_gates:
            if r.place is not Place.WAITING:
                continue  # ended (a failed grammar, an abort)
            gate = r.gate
            if gate.done() and gate.exception() is None:
                r.gate_open = True
                opened.append(r.rid)
            else:
                closed.append(r)
        self._closed_gates = closed
        return opened

    def _checked_stop(self, req: Req) -> bool:
        """The engine's stop checker, its verdicts journalled (a replay has no text to check)."""
        assert self._stop_checker is not None, "no stop checker"
        try:
            hit = self._stop_checker(req)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            self.journal.append(
                {"op": "stop", "rid": req.rid, "n": len(req.output_ids), "raised": True, "message": text}
            )
            raise
        if hit:
            self.journal.append({"op": "stop", "rid": req.rid, "n": len(req.output_ids)})
        return bool(hit)

    # -- request state: every status change and queue move is made here (batch_builder.py, retraction.py
    # and preemption.py call these through the Queues protocol) --------------------------------------
    def unlink(self, req: Req) -> None:
        """Take a live request out of the queue that holds it (its `place`)."""
        place = req.place
        if place is Place.WAITING:
            self.waiting.remove(req)
        elif place is Place.RUNNING:
            self.running.remove(req)
            self.batch_is_full = False  # a request left the running batch: admission may resume
        elif place is Place.CHUNKED:
            self.chunked_req = None
        elif place is Place.LIMBO:
            self.in_flight.limbo.remove(req)
        req.place = Place.NONE

    def _put(self, req: Req, place: Place, at: int | None = None) -> None:
        """Move `req` from its queue to `place` (`at`: its index in the waiting queue; default the end)."""
        self.unlink(req)
        if place is Place.WAITING:
            self.waiting.insert(len(self.waiting) if at is None else at, req)
        elif place is Place.RUNNING:
            self.running.append(req)
        elif place is Place.CHUNKED:
            if self.chunked_req is not None:
                raise RuntimeError(f"{req.rid}: carried while {self.chunked_req.rid} is carried")
            self.chunked_req = req
        elif place is Place.LIMBO:
            self.in_flight.limbo.append(req)
        req.place = place

    def admit(self, admitted: list[Req], aging: bool) -> None:
        """The waiting requests the PrefillAdder admitted into this step's batch leave the queue (with
        `aging`, those they overtook count it) and start prefilling."""
        self.waiting = take_admitted(self.waiting, admitted, aging=aging)
        now = time.monotonic()
        for req in admitted:
            req.place = Place.NONE  # (out of the queue all at once: take_admitted)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._set_status(req, ReqStatus.PREFILLING)

    def reorder_running(self, ordered: list[Req]) -> None:
        """Keep `ordered` (the running requests, each once) as the running batch's order."""
        if len(ordered) != len(self.running):
            raise RuntimeError("reorder_running: not a permutation of the running requests")
        self.running[:] = ordered

    def reorder_waiting(self, ordered: list[Req]) -> None:
        """Keep `ordered` (the waiting requests, each once) as the waiting queue's order (SGLang sorts in place)."""
        if len(ordered) != len(self.waiting):
            raise RuntimeError("reorder_waiting: not a permutation of the waiting queue")
        self.waiting[:] = ordered

    def take_carried(self) -> Req | None:
        """The carried chunked request, out of its place (this round's batch offers it first), or None."""
        req = self.chunked_req
        if req is not None:
            self.unlink(req)
        return req

    def carry(self, req: Req | None) -> None:
        """`req` (a prefilling request whose prompt is not done) is carried to the next round."""
        if req is not None:
            self._put(req, Place.CHUNKED)

    def end(self, req: Req, kv_len: int, status: ReqStatus, reason: FinishReason) -> None:
        """Finish or abort a live request holding `kv_len` tokens of valid K/V (placeholders dropped)."""
        self.unlink(req)
        req.pending_ids.clear()
        req.kv_len = kv_len
        self.in_flight.aborted.discard(id(req))
        if status is ReqStatus.FINISHED and req.max_new_tokens == 0:
            self.forks.keep(req)  # an n > 1 prefill: its choices copy its partial last page (forks.py)
        last = self.forks.release(req)  # a choice ending before it copied the kept page
        if last is not None:
            self.pool.free([last])
        self.tree.cache_finished_req(req, self.pool)  # KV into the radix cache, locks dropped, rest freed
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self._set_status(req, status, reason.value)
        del self.reqs[req.rid]

    def retract(self, req: Req, note: str = "", at: int | None = 0, cache: bool = True) -> None:
        """Back to the waiting queue, at index `at` (the head by default; None: the end): its full pages stay
        cached (`cache=False`: only those the tree held already), the rest are freed. A request of a launched
        batch (preemption) keeps only its committed K/V; its token is dropped."""
        self.unlink(req)
        req.kv_len = self.in_flight.committed_len(req)
        req.pending_ids.clear()
        if cache:
            self.tree.cache_finished_req(req, self.pool)
        else:
            self.tree.release_req(req, self.pool)
        req.num_retractions += 1
        self.num_preempted += note == "preempted"  # preemption.py's note; memory retractions are counted per step
        self._set_status(req, ReqStatus.RETRACTED, note)
        self._set_status(req, ReqStatus.WAITING)
        self._put(req, Place.WAITING, at)

    def cache_unfinished(self, req: Req, kv_len: int) -> None:
        self.tree.cache_unfinished_req(req, self.pool, kv_len)

    # -- events and stats -----------------------------------------------------
    def record(self, req: Req, src: ReqStatus | None, dst: ReqStatus, note: str = "", at: float | None = None) -> None:
        # output_len counts placeholders: a prompt completes (-> RUNNING) at launch, which the plain
        # step does right after the forward sampled its first token.
        self.events.append(
            Event(
                time=time.monotonic() if at is None else at,
                step=self.step_count,
                rid=req.rid,
                src=src,
                dst=dst,
                prompt_len=req.prompt_len,
                output_len=len(req.output_ids) + len(req.pending_ids),
                kv_len=req.kv_len,
                cached_len=req.cache_hit_tokens,
                note=note,
            )
        )

    def _set_status(self, req: Req, dst: ReqStatus, note: str = "") -> None:
        self.record(req, req.status, dst, note)
        req.status = dst

    def _record_step(self, batch: Batch, n_retracted: int, hits: int) -> None:
        pool, tree = self.pool, self.tree
        self.num_retracted += n_retracted
        decode = batch.num_decode
        drafts = sum(map(len, batch.drafts))
        self.step_stats.append(
            StepStats(
                step=self.step_count,
                time=time.monotonic(),
                mode=batch.mode.value,
                batch_size=batch.batch_size,
                num_prefill_tokens=batch.num_tokens - decode - drafts,
                num_decode_tokens=decode,
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                free_pages=pool.num_free,
                cached_pages=tree.total_pages,
                evictable_pages=tree.evictable_pages,
                token_usage=1 - (pool.num_free + tree.evictable_pages) / pool.num_pages,
                cache_hit_tokens=hits,
                num_retracted=n_retracted,
                new_token_ratio=self.new_token_ratio,
                num_draft_tokens=drafts,
            )
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool, the radix cache and the queues agree
        (invariants.py). Call between steps (no batch built and not launched)."""
        check_scheduler(self)
