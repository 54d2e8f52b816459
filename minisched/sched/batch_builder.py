"""Building one step's batch: prefill first, mixed chunks, decode with retraction (scheduler.py).

`build(sched)` returns (batch or None, requests retracted, prefix tokens reused). Order:
1. unless a decode is due (`max_prefill_rounds_between_decodes` prefill-only rounds ran while
   requests wait to decode), a prefill batch: the carried chunked request first, then waiting
   requests in policy order through the PrefillAdder (skipping, for one round, requests whose
   uncached prefix another request in the batch is computing: deferral.py); with priority
   scheduling, by priority first, preempting less urgent running requests (preemption.py);
2. with `enable_mixed_chunk`, the running requests ride along if their pages fit;
3. otherwise decode the running requests, retracting some first if their next pages do not
   fit even after evicting the radix cache -- but never while a batch is launched: its tokens
   are resolved first (overlap scheduling), so a retracted request never has placeholders;
   with a drafter (spec.py) the decode is a VERIFY batch where requests have drafts. Nothing
   is built while a VERIFY batch is launched.

It reads and changes the scheduler's queues through the `Queues` protocol (queues.py).
Pure Python.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from minisched.base.values import cdiv
from minisched.sched import preemption
from minisched.sched.batch import Batch, ForwardMode
from minisched.sched.decisions import Reason, not_ready, sharer, stop_reason, users
from minisched.sched.deferral import InBatchPrefixes
from minisched.sched.prefill_adder import AddResult, PrefillAdder
from minisched.sched.queues import Queues
from minisched.sched.req import Place, Req
from minisched.sched.retraction import evict_for, make_room_for_decode


def build(sched: Queues) -> tuple[Batch | None, int, int]:
    cfg, launched = sched.config, sched.in_flight.launched
    if launched and launched[-1].mode is ForwardMode.VERIFY:
        sched.why.no_prefill = Reason.VERIFY_PENDING.value
        return None, 0, 0  # its accepted lengths decide the next step: resolve it first (spec.py)
    k = cfg.max_prefill_rounds_between_decodes
    decode_due = bool(sched.running) and k is not None and sched.prefill_rounds >= k
    if decode_due and (sched.waiting or sched.chunked_req is not None):
        sched.why.no_prefill = Reason.DECODE_TURN.value
    batch, hits, adder = (None, 0, None) if decode_due else prefill_batch(sched)
    n_retracted = 0
    if batch is not None and cfg.enable_mixed_chunk and sched.running:
        batch = mix(sched, batch)
    if adder is not None:  # only now: mix's decode pages must not evict the batch's copy sources
        adder.finish()
    spec = sched.speculator
    if batch is None and sched.running and launched and spec is not None:
        if spec.wants_drain(sched.running, sched.step_count):
            return None, 0, 0  # resolve the launched decode, so that this step can draft
    if batch is None and sched.running and not (launched and not decode_fits(sched)):
        n_retracted = make_room_for_decode(sched)
        if sched.running:
            batch = decode_batch(sched, n_retracted)
    return batch, n_retracted, hits


def new_adder(sched: Queues, **rules: Any) -> PrefillAdder:
    """This round's PrefillAdder over the scheduler's pool, cache and budgets; `rules`: the path's own fields."""
    cfg = sched.config
    return PrefillAdder(
        pool=sched.pool,
        tree=sched.tree,
        new_token_ratio=sched.new_token_ratio,
        rem_input_tokens=cfg.max_prefill_tokens,
        rem_chunk_tokens=cfg.chunk_size,
        max_new_reqs=cfg.max_running_requests - len(sched.running),
        running=sched.running,
        clip_estimate=cfg.clip_max_new_tokens_estimation,
        forks=sched.forks,
        input_check_with_chunking=cfg.max_prefill_tokens_with_chunking,
        conservative_eviction=cfg.conservative_eviction,
        **rules,
    )


def prefill_batch(sched: Queues) -> tuple[Batch | None, int, PrefillAdder | None]:
    """(the prefill batch or None, prefix tokens its admitted requests reuse)."""
    cfg, why = sched.config, sched.why
    if cfg.admission_budget == "sglang":
        return prefill_batch_sglang(sched)
    if sched.chunked_req is None and not sched.waiting:
        return None, 0, None
    pause, running_before = cfg.pause_admission_when_full, bool(sched.running)
    if pause:
        reset_batch_is_full(sched)
        if sched.chunked_req is None and sched.batch_is_full:
            return None, 0, None
    prio = cfg.priority_scheduling
    if prio and sched.waiting:
        ready = [r for r in sched.waiting if r.ready]
        carried = sched.chunked_req
        if carried is not None and ready:
            head = min(ready, key=lambda r: preemption.effective(r, sched.step_count, cfg.priority_aging_steps))
            if preemption.preempts(sched, head, carried):
                why.retract(carried, f"preempted_for:{head.rid}", [])
                preemption.preempt(sched, None, [carried])
    if sched.chunked_req is None and len(sched.running) >= cfg.max_running_requests:
        if not (prio and preemption.may_preempt(sched, [r for r in sched.waiting if r.ready])):
            why.no_prefill = Reason.RUNNING_CAP.value
            return None, 0, None
    defer = None
    if cfg.in_batch_prefix_rule == "defer" and cfg.in_batch_prefix_defer_tokens is not None and not sched.tree.disable:
        defer = InBatchPrefixes(cfg.page_size, cfg.in_batch_prefix_defer_tokens)
    mixed = len(sched.running) if cfg.enable_mixed_chunk else 0  # decode rows riding along
    adder = new_adder(sched, mixed_decode_tokens=mixed, defer=defer, chunk_floor=cfg.chunk_rule == "sglang")
    carried = sched.take_carried()
    if carried is not None and not adder.add_chunked_req(carried):
        why.no_prefill = Reason.CARRIED_FIRST.value
        why.stop(carried, Reason.KV_PAGES, users(Reason.KV_PAGES, adder, sched.running))
        sched.carry(carried)  # its pages do not fit yet: decode first
        return None, 0, None
    if (adder.new_chunked_req is None or cfg.chunk_rule == "sglang") and sched.waiting:
        # a request preempted while its row is in a launched batch waits for that batch to resolve
        busy = sched.in_flight.launched_rows() if sched.in_flight.launched and prio else ()
        ordered = sched.policy.order(sched.waiting)
        if cfg.policy_sort == "sglang":  # the sort is kept as the queue's order
            sched.reorder_waiting(ordered)
            ordered = list(sched.waiting)
        ready = ready_requests(sched, ordered, busy)
        if prio:
            ready = preemption.order(ready, sched.step_count, cfg.priority_aging_steps)
        admitted = adder.add_waiting(ready)
        while prio and adder.blocked is not None:
            head = adder.blocked
            victims = preemption.plan(sched, adder, head)
            if not victims:
                break
            for v in victims:
                why.retract(v, f"preempted_for:{head.rid}", [r for r in sched.running if r not in victims])
            preemption.preempt(sched, adder, victims)
            admitted += adder.add_waiting(ready[ready.index(head) :])
        note_waiting(sched, adder, ready)
        if admitted:
            sched.admit(admitted, aging=sched.policy.active(len(sched.waiting)) != "fcfs")
        if pause and adder.blocked is not None:  # SGLang's batch_is_full: out of slots, or of KV beside others
            out_of_kv = adder.blocked_result is AddResult.NO_TOKEN and bool(adder.can_run or sched.running)
            out_of_slots = len(adder.can_run) >= adder.max_new_reqs
            sched.batch_is_full = (out_of_kv or out_of_slots) and running_before
    for r, p, e in zip(adder.can_run, adder.prefix_lens, adder.extend_lens):
        why.admit(r, p, e, r is adder.new_chunked_req)
    sched.carry(adder.new_chunked_req)
    if not adder.can_run:
        adder.finish()
        return None, adder.cache_hit_tokens, None
    batch = Batch(
        mode=ForwardMode.PREFILL,
        reqs=adder.can_run,
        prefix_lens=adder.prefix_lens,
        extend_lens=adder.extend_lens,
        page_size=cfg.page_size,
        loads=adder.loads,
        copies=adder.copies,
        free_after=adder.free_after,
    )
    return batch, adder.cache_hit_tokens, adder


def reset_batch_is_full(sched: Queues) -> None:
    """SGLang's batch_is_full also clears when a row of the last prefill did not join the running batch
    (chunked, finished) and when nothing runs (a running request leaving clears it: Scheduler.unlink)."""
    last = sched.last_batch
    if last is not None and last.mode is ForwardMode.PREFILL and any(r.place is not Place.RUNNING for r in last.reqs):
        sched.batch_is_full = False
    if not sched.running:
        sched.batch_is_full = False


def ready_requests(sched: Queues, ordered: list[Req], busy: Collection[int] = ()) -> list[Req]:
    """The requests that may be offered, in order; the others are noted with why they wait (`busy`: ids of
    preempted requests whose rows are still in a launched batch)."""
    ready = []
    for r in ordered:
        if not r.ready:
            sched.why.skip(r, not_ready(r))
        elif id(r) in busy:
            sched.why.skip(r, Reason.BUSY)
        else:
            ready.append(r)
    return ready


def note_waiting(sched: Queues, adder: PrefillAdder, ready: list[Req]) -> None:
    """Why the offered requests that were not admitted wait: deferred ones, and the one the batch stopped
    at (refused by a budget, or the next in line after a truncated admission spent the chunk)."""
    why = sched.why
    for r in adder.prefix_deferred:
        why.skip(r, Reason.PREFIX_DEFER, sharer(r, adder.can_run))
    stopped, result = adder.blocked, adder.blocked_result
    if stopped is None and adder.new_chunked_req is not None:
        taken = {id(r) for r in adder.can_run} | {id(r) for r in adder.prefix_deferred}
        stopped = next((r for r in ready if id(r) not in taken), None)
    if stopped is not None:
        reason = stop_reason(adder, result)
        why.stop(stopped, reason, users(reason, adder, sched.running))


def prefill_batch_sglang(sched: Queues) -> tuple[Batch | None, int, PrefillAdder | None]:
    """SGLang 0.5.23's get_new_batch_prefill (admission_budget="sglang"; no priorities, host tier or fork copies):
    with `pause_admission_when_full`, nothing is admitted after the KV budget or the slots ran out until a
    running request leaves; the carried chunk always runs; waiting requests in policy order (kept as the
    queue's order with policy_sort="sglang") through `PrefillAdder.add_waiting_sglang`; pages allocated
    once the batch is chosen."""
    cfg = sched.config
    pause = cfg.pause_admission_when_full
    reset_batch_is_full(sched)
    running_before = bool(sched.running)
    carried = sched.chunked_req
    if carried is None and (not sched.waiting or (pause and sched.batch_is_full)):
        return None, 0, None
    if carried is None and len(sched.running) >= cfg.max_running_requests:
        sched.batch_is_full = pause
        return None, 0, None
    ordered = sched.policy.order(sched.waiting)
    if cfg.policy_sort == "sglang":
        sched.reorder_waiting(ordered)
        ordered = list(sched.waiting)
    adder = new_adder(
        sched,
        sglang=True,
        chunk_floor=True,
    )
    carried = sched.take_carried()
    if carried is not None:
        adder.add_chunked_req_sglang(carried)
    if sched.waiting and (cfg.chunk_rule == "sglang" or adder.new_chunked_req is None):
        ready = ready_requests(sched, ordered)
        admitted = adder.add_waiting_sglang(ready)
        note_waiting(sched, adder, ready)
        if admitted:
            sched.admit(admitted, aging=sched.policy.active(len(sched.waiting)) != "fcfs")
    if pause and adder.full is not None:
        sched.batch_is_full = adder.full and running_before  # (an empty running batch starts afresh next step)
    sched.carry(adder.new_chunked_req)
    if not adder.can_run:
        adder.finish()
        return None, adder.cache_hit_tokens, None
    adder.allocate_deferred()
    for r, p, e in zip(adder.can_run, adder.prefix_lens, adder.extend_lens):
        sched.why.admit(r, p, e, r is adder.new_chunked_req)
    batch = Batch(
        mode=ForwardMode.PREFILL,
        reqs=adder.can_run,
        prefix_lens=adder.prefix_lens,
        extend_lens=adder.extend_lens,
        page_size=cfg.page_size,
    )
    return batch, adder.cache_hit_tokens, adder


def mix(sched: Queues, batch: Batch) -> Batch:
    """Let the decode requests ride along with the prefill chunk if their pages fit."""
    running = sched.running
    if not decode_fits(sched) or not sched.pool.alloc_for_decode(running):
        return batch
    n = len(running)
    return Batch(
        mode=ForwardMode.MIXED,
        reqs=batch.reqs + running,
        prefix_lens=batch.prefix_lens + [r.kv_len for r in running],
        extend_lens=batch.extend_lens + [1] * n,
        page_size=batch.page_size,
        sampled=batch.sampled + [True] * n,
        num_decode=n,
        loads=batch.loads,
        copies=batch.copies,
        free_after=batch.free_after,
    )


def decode_batch(sched: Queues, n_retracted: int) -> Batch:
    cfg = sched.config
    if not n_retracted:  # (after a retraction make_room_for_decode re-estimated it)
        decay = (cfg.init_new_token_ratio - cfg.min_new_token_ratio) / cfg.new_token_ratio_decay_steps
        sched.new_token_ratio = max(cfg.min_new_token_ratio, sched.new_token_ratio - decay)
    if cfg.conservative_eviction:  # SGLang's decode allocation evicts as if every row needed a new page
        evict_for(sched, len(sched.running) * cfg.page_size)
    if not sched.pool.alloc_for_decode(sched.running):
        raise RuntimeError("decode pages do not fit after retraction")  # make_room_for_decode ensures they do
    reqs = list(sched.running)
    n = len(reqs)
    spec = sched.speculator
    ks = spec.lengths(reqs, sched.max_context_len) if spec is not None and not sched.in_flight.launched else None
    drafts = draft(sched, reqs, ks) if ks is not None else None
    return Batch(
        mode=ForwardMode.VERIFY if drafts else ForwardMode.DECODE,
        reqs=reqs,
        prefix_lens=[r.kv_len for r in reqs],
        extend_lens=[1 + len(d) for d in drafts] if drafts else [1] * n,
        page_size=cfg.page_size,
        sampled=[True] * n,
        num_decode=n,
        drafts=drafts or [],
    )


def draft(sched: Queues, reqs: list[Req], ks: list[int]) -> list[list[int]] | None:
    """Whole pages for each row's drafts (after its decode token's), evicting the radix cache if needed --
    a row whose pages do not fit drafts only what its last page holds --, then the drafts; the pages a
    shorter draft does not need go back. None if no row drafts."""
    pool, ps = sched.pool, sched.config.page_size
    for i, (r, k) in enumerate(zip(reqs, ks)):
        if not k:
            continue
        need = pool.pages_needed(r, 1 + k)
        if need > pool.num_free:
            pool.free(sched.tree.evict(need - pool.num_free))
        if need > 0 and not pool.alloc_for_extend(r, 1 + k):
            ks[i] = len(r.page_ids) * ps - r.kv_len - 1
    if not any(ks):
        return None
    spec = sched.speculator
    assert spec is not None, "drafting without a speculator"
    drafts = spec.worth(reqs, ks, spec.propose(reqs, ks), sched.step_count)
    for r, d in zip(reqs, drafts):
        keep = cdiv(r.kv_len + 1 + len(d), ps)
        if len(r.page_ids) > keep:
            pool.free(r.page_ids[keep:])
            del r.page_ids[keep:]
    return drafts if any(drafts) else None


def decode_fits(sched: Queues) -> bool:
    """Do the running requests' next pages fit, after evicting the radix cache as needed?"""
    pool = sched.pool
    need = pool.decode_pages_needed(sched.running)
    if need > pool.num_free:
        pool.free(sched.tree.evict(need - pool.num_free))
    return need <= pool.num_free
