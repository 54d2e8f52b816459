"""Retraction under KV pressure (SGLang's ScheduleBatch.retract_decode), and the stall guard.

When the next decode step's pages do not fit even after evicting the radix cache, the
scheduler (`Scheduler.make_room_for_decode`) retracts running requests back to the head of
the waiting queue:

- victim: fewest decoded tokens first (least work lost), ties: longest prompt (most pages);
  with priority scheduling the least urgent (effective priority, preemption.py) first;
- afterwards `new_token_ratio` is re-estimated from what the remaining requests have
  actually decoded (`reestimate_ratio`), instead of being reset to its initial value.

SGLang 0.5.23 (`retraction_rule="sglang"`, `retract_sglang`) differs: it retracts at least one
request even when evicting would do, frees the victim's KV without caching it, evicts the radix
cache for `retract_decode_steps` tokens per remaining request after each victim, breaks ties
by the latest in batch order and divides the new ratio by `sum(max_new_tokens) + 1` (the
limits as asked, not clipped); `retracted_to_tail` puts the victims at the end of the queue.

`make_room_for_decode` and `fail_stalled` act on the scheduler's queues through its public
methods (queues.py); the rest are pure functions over requests and the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from minisched.base.values import cdiv
from minisched.sched.kv_pool import KVPool
from minisched.sched.preemption import effective
from minisched.sched.queues import Queues
from minisched.sched.radix_cache import RadixCache
from minisched.sched.req import FinishReason, Req, ReqStatus


def pick_victim(running: Sequence[Req], now: int = 0, aging_steps: int | None = None, priority: bool = False) -> Req:
    """Fewest decoded tokens, then longest prompt; with priority scheduling the least urgent first."""
    if priority:
        return min(running, key=lambda r: (-effective(r, now, aging_steps), len(r.output_ids), -r.prompt_len))
    return min(running, key=lambda r: (len(r.output_ids), -r.prompt_len))


def reestimate_ratio(running: Sequence[Req], steps: int) -> float:
    """min(1, (decoded + steps * batch) / sum(max_new_tokens)) over the requests that stay (SGLang divides by
    the sum of the asked limits + 1: `retract_sglang`)."""
    total = sum(r.max_new_tokens for r in running)
    if total <= 0:
        return 1.0
    return min(1.0, (sum(len(r.output_ids) for r in running) + steps * len(running)) / total)


def stall_reason(req: Req, pool: KVPool, tree: RadixCache, steps: int) -> tuple[FinishReason, str | None]:
    """Defence in depth: work but no batch for `steps` steps with nothing running cannot resolve
    itself (no running request will free pages). A request that cannot fit even the whole pool
    ends with LENGTH; any other with ERROR and this message."""
    if cdiv(req.seq_len, pool.page_size) > pool.num_pages:
        return FinishReason.LENGTH, None
    return FinishReason.ERROR, (
        f"scheduler stalled: no batch could be formed for {steps} steps with nothing "
        f"running ({pool.num_free} free + {tree.evictable_pages} evictable of "
        f"{pool.num_pages} pages)"
    )


def evict_for(sched: Queues, n_tokens: int) -> None:
    """SGLang's evict_to_free_tokens: evict the radix cache until `n_tokens` tokens are free (or nothing is
    left to evict)."""
    pool = sched.pool
    short = n_tokens - pool.num_free * pool.page_size
    if short > 0:
        pool.free(sched.tree.evict(cdiv(short, pool.page_size)))


def decode_fits_sglang(sched: Queues, reqs: Sequence[Req]) -> bool:
    """SGLang's check_decode_mem: a page per row whose last page is full, after evicting for them."""
    pool = sched.pool
    need = pool.decode_pages_needed(reqs) * pool.page_size
    evict_for(sched, need)
    return pool.num_free * pool.page_size >= need


def retract_sglang(sched: Queues) -> int:
    """SGLang 0.5.23's retract_decode: at least one victim (fewest decoded tokens, then longest prompt; ties: the
    latest in batch order), each released without caching its KV and followed by evicting room for
    `retract_decode_steps` tokens per remaining request, until the next step fits; never the last request.
    The victims go to the end of the waiting queue (`retracted_to_tail`) or its head; the rest stay in
    SGLang's keep order; the ratio becomes (decoded + steps * n) / (sum of max_new_tokens + 1), at most 1."""
    cfg, running = sched.config, sched.running
    steps = cfg.retract_decode_steps
    keep = sorted(running, key=lambda r: (len(r.output_ids), -r.prompt_len), reverse=True)
    retracted: list[Req] = []
    while not retracted or not decode_fits_sglang(sched, keep):
        if len(keep) == 1:
            break
        victim = keep.pop()
        sched.why.retract(victim, "decode_pages", keep[::-1])  # the next candidates first
        sched.retract(victim, at=None if cfg.retracted_to_tail else len(retracted), cache=False)
        retracted.append(victim)
        evict_for(sched, len(keep) * steps)
    if len(keep) == 1 and not decode_fits_sglang(sched, keep):  # it alone outgrew the pool (pages leaked)
        req = keep.pop()
        sched.end(req, req.kv_len, ReqStatus.FINISHED, FinishReason.LENGTH)
        sched.finished_early(req)
    sched.reorder_running(keep)
    total = sum(r.sampling.max_new_tokens for r in keep)
    sched.new_token_ratio = min(1.0, (sum(len(r.output_ids) for r in keep) + steps * len(keep)) / (total + 1))
    return len(retracted)


def make_room_for_decode(sched: Queues) -> int:
    """Evict, then retract until the next decode step's pages fit, then re-estimate
    new_token_ratio. Returns the number of retracted requests."""
    if sched.config.retraction_rule == "sglang":
        return retract_sglang(sched) if not decode_fits_sglang(sched, sched.running) else 0
    pool, running, retracted = sched.pool, sched.running, list[Req]()
    while True:
        need = pool.decode_pages_needed(running)
        if need > pool.num_free:
            pool.free(sched.tree.evict(need - pool.num_free))
        if need <= pool.num_free:
            break
        carried = sched.chunked_req
        if len(running) == 1 and carried is None:
            # it alone outgrew the pool: only possible if pages leaked (arrival clips max_new_tokens)
            req = running[0]
            sched.end(req, req.kv_len, ReqStatus.FINISHED, FinishReason.LENGTH)
            sched.finished_early(req)
            break
        if len(running) == 1 and carried is not None:
            victim = carried
        else:
            cfg = sched.config
            victim = pick_victim(running, sched.step_count, cfg.priority_aging_steps, cfg.priority_scheduling)
        others = sorted((r for r in running if r is not victim), key=lambda r: len(r.output_ids))
        sched.why.retract(victim, "decode_pages", others)
        # the retracted go to the queue's head, in this order (or, retracted_to_tail, to its end)
        sched.retract(victim, at=None if sched.config.retracted_to_tail else len(retracted))
        retracted.append(victim)
    if retracted:
        if running:
            sched.new_token_ratio = reestimate_ratio(running, sched.config.retract_decode_steps)
    return len(retracted)


def fail_stalled(sched: Queues) -> None:
    """Work but no batch for `max_stalled_steps` steps with nothing running cannot resolve itself:
    end the stuck requests (`stall_reason` says how)."""
    stuck = ([sched.chunked_req] if sched.chunked_req is not None else []) + list(sched.waiting)
    for req in stuck:
        reason, req.error = stall_reason(req, sched.pool, sched.tree, sched.stalled)
        sched.end(req, req.kv_len, ReqStatus.FINISHED, reason)
        sched.finished_early(req)
    sched.stalled = 0
