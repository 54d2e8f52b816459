"""Retraction under KV pressure (SGLang's ScheduleBatch.retract_decode), and the stall guard.

When the next decode step's pages do not fit even after evicting the radix cache, the
scheduler retracts running requests back to the waiting queue:

- victim: fewest decoded tokens first (least work lost), ties: longest prompt (most pages);
- afterwards `new_token_ratio` is re-estimated from what the remaining requests have
  actually decoded (`reestimate_ratio`), instead of being reset to its initial value.

SGLang also keeps retracting until the rest have room for `retract_decode_steps` more
tokens each. Measured with the fake runner (benchmarks/RESULTS.md) that retracted more
requests and recomputed more tokens for no fewer steps, so only the next step is made room for.

`make_room_for_decode` and `fail_stalled` act on the Scheduler's queues (as overlap.py does);
`pick_victim` and `reestimate_ratio` are pure functions over requests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from minisched.sched.kv_pool import cdiv
from minisched.sched.req import FinishReason, Req, ReqStatus

if TYPE_CHECKING:
    from minisched.sched.scheduler import Scheduler


def pick_victim(running: Sequence[Req]) -> Req:
    return min(running, key=lambda r: (len(r.output_ids), -r.prompt_len))


def reestimate_ratio(running: Sequence[Req], steps: int) -> float:
    """SGLang: min(1, (decoded + steps * batch) / sum(max_new_tokens)) over the requests that stay."""
    total = sum(r.max_new_tokens for r in running)
    if total <= 0:
        return 1.0
    return min(1.0, (sum(len(r.output_ids) for r in running) + steps * len(running)) / total)


def make_room_for_decode(sched: Scheduler) -> int:
    """Evict, then retract until the next decode step's pages fit, then
    re-estimate new_token_ratio. Returns the number of retracted requests."""
    pool, running, retracted = sched.pool, sched.running, []
    while True:
        need = pool.decode_pages_needed(running)
        if need > pool.num_free:
            pool.free(sched.tree.evict(need - pool.num_free))
        if need <= pool.num_free:
            break
        if len(running) == 1 and sched.chunked_req is None:
            # it alone outgrew the pool: only possible if pages leaked (arrival clips max_new_tokens)
            req = running.pop()
            sched._release(req, ReqStatus.FINISHED, FinishReason.LENGTH)
            sched._finished_early.append(req)
            break
        if len(running) == 1:
            victim, sched.chunked_req = sched.chunked_req, None
        else:
            victim = pick_victim(running)
            running.remove(victim)
        sched._retract(victim)
        retracted.append(victim)
    if retracted:
        sched.waiting[:0] = retracted
        if running:
            sched.new_token_ratio = reestimate_ratio(running, sched.config.retract_decode_steps)
    return len(retracted)


def fail_stalled(sched: Scheduler) -> None:
    """Defence in depth: work but no batch for `max_stalled_steps` steps with nothing running
    cannot resolve itself (no running request will free pages), so end the stuck requests:
    LENGTH if one cannot fit even the whole pool, else ERROR with the reason in `req.error`."""
    pool, tree, n = sched.pool, sched.tree, sched._stalled
    stuck = ([sched.chunked_req] if sched.chunked_req is not None else []) + list(sched.waiting)
    for req in stuck:
        sched._unlink(req)
        if cdiv(req.seq_len, pool.page_size) > pool.num_pages:
            reason = FinishReason.LENGTH
        else:
            reason = FinishReason.ERROR
            req.error = (f"scheduler stalled: no batch could be formed for {n} steps with nothing running "
                         f"({pool.num_free} free + {tree.evictable_pages} evictable of {pool.num_pages} pages)")
        sched._release(req, ReqStatus.FINISHED, reason)
        sched._finished_early.append(req)
    sched._stalled = 0
