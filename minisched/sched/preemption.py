"""Priority scheduling: the effective priority, the waiting order, and preemption (SchedulerConfig.priority_*).

`SamplingParams.priority` is vLLM's: a lower value is more urgent. With `priority_scheduling`:

- **Order.** The ready waiting requests are offered to the PrefillAdder by effective priority,
  then in the policy's order (a stable sort of the policy's list), so the policy still decides
  among equals. The adder stops at the first request that does not fit, so nothing less urgent
  overtakes it.
- **Aging.** `effective(r) = r.priority - (now - r.arrival_step) // priority_aging_steps`
  (`now`: the scheduler's step count). Every request ages at the same rate, so a request of
  priority p is never ordered behind, nor preempted for, a request of priority q that arrived
  `(p - q + 1) * priority_aging_steps` steps or more after it: only the arrivals of a bounded
  window can overtake it, and it starves never (tests/sched/test_priority.py). Aging also
  counts while a request runs, so an old request becomes hard to preempt. Two requests'
  effective priorities drift apart by at most one, so preemption never ping-pongs.
- **Preemption.** When the most urgent request that is not admitted failed for KV room or a
  request slot, the running requests of a less urgent class (`priority`) whose effective
  priority is worse than its by more than `priority_preemption_threshold` are candidates
  (aging reorders within a class but never makes a class preempt itself), least urgent first, then newest arrival first
  (SGLang's order). They are retracted only if, together, they make room (`plan`: their own
  pages, the pages of cache nodes no one else locks, their reserved future tokens and their
  slots); then the request is offered again. A carried chunked prefill is preempted the same
  way by a ready request more urgent than it by more than the threshold (its computed full
  pages stay in the radix cache, so little is lost).

A preempted request is retracted as under memory pressure (its full pages stay in the radix
cache, the rest are freed, it waits again), and may sit in the launched batch of an overlapped
step: it keeps only its committed K/V (`InFlight.committed_len`, as an abort does) and its row's
token is dropped when that batch resolves, so the pool and the cache only ever hold K/V that
resolved steps wrote. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from minisched.base.values import cdiv
from minisched.sched.prefill_adder import AddResult, PrefillAdder
from minisched.sched.queues import Queues
from minisched.sched.radix_cache import TreeNode
from minisched.sched.req import Req


def effective(req: Req, now: int, aging_steps: int | None) -> int:
    """`req`'s priority `now` (lower is more urgent), aged by the steps since it arrived."""
    if aging_steps is None:
        return req.sampling.priority
    return req.sampling.priority - max(0, now - req.arrival_step) // aging_steps


def order(reqs: Sequence[Req], now: int, aging_steps: int | None) -> list[Req]:
    """The requests by effective priority, ties in the given (policy) order."""
    return sorted(reqs, key=lambda r: effective(r, now, aging_steps))


def may_preempt(sched: Queues, ready: Sequence[Req]) -> bool:
    """Could a ready waiting request preempt a running one (so a full batch must still try admission)?"""
    cfg, now = sched.config, sched.step_count
    thr, aging = cfg.priority_preemption_threshold, cfg.priority_aging_steps
    if not cfg.priority_scheduling or thr is None or not ready or not sched.running:
        return False
    head = min(ready, key=lambda r: effective(r, now, aging))
    return any(preempts(sched, head, r) for r in sched.running)


def preempts(sched: Queues, head: Req, victim: Req) -> bool:
    """May `head` preempt `victim`: a less urgent class, and worse by more than the threshold now?"""
    cfg, now = sched.config, sched.step_count
    aging = cfg.priority_aging_steps
    thr = cfg.priority_preemption_threshold
    return (
        thr is not None
        and victim.sampling.priority > head.sampling.priority
        and effective(victim, now, aging) - effective(head, now, aging) > thr
    )


def plan(sched: Queues, adder: PrefillAdder, head: Req) -> list[Req]:
    """The running requests to retract so that `head` (which the adder just turned down) fits; [] if
    retracting every candidate would still not make room, or it was turned down for a batch budget."""
    result = adder.blocked_result
    if result is not AddResult.NO_TOKEN and result is not AddResult.OTHER:
        return []
    now, aging = sched.step_count, sched.config.priority_aging_steps
    cands = [r for r in sched.running if preempts(sched, head, r)]
    if not cands:
        return []
    pool, tree = sched.pool, sched.tree
    ps = pool.page_size
    slots_short = len(adder.can_run) + 1 - adder.max_new_reqs
    if adder.rem_chunk_tokens is not None and adder.rem_chunk_tokens <= 0:
        return []  # the batch's chunk budget is spent: it goes next round
    key = head.fill_ids if head.output_ids else head.prompt_ids
    limit = head.seq_len - 1 if head.logits_from is None else min(head.seq_len - 1, head.logits_from)
    pages, node = tree.match_prefix(key, limit)
    n, truncated = adder.chunk_len(head.seq_len - len(pages) * ps)
    if adder.can_run and n > adder.rem_input_tokens:
        return []  # the batch's input budget: not a question of room
    need = (cdiv(len(pages) * ps + n, ps) - len(pages)) * ps + (0 if truncated else adder.reserved_for(head))
    tree.inc_lock_ref(node)  # as add_one_req: the head's own prefix is not room
    short = need - adder.rem_total_tokens
    tree.dec_lock_ref(node)
    locked: set[int] = set()
    node_: TreeNode | None = node
    while node_ is not tree.root:
        assert node_ is not None, "the head's match leaves the radix tree"
        locked.add(id(node_))
        node_ = node_.parent
    cands.sort(key=lambda r: (-effective(r, now, aging), -r.arrival_seq))
    through: dict[int, int] = {}
    chosen = []
    for v in cands:
        if short <= 0 and slots_short <= 0:
            break
        chosen.append(v)
        slots_short -= 1
        short -= (len(v.page_ids) - v.n_cached_pages) * ps + adder.reserved_for(v)
        nd = v.last_node
        while nd is not None and nd is not tree.root:  # cache nodes only the victims lock become evictable
            through[id(nd)] = through.get(id(nd), 0) + 1
            if through[id(nd)] == nd.lock_ref and id(nd) not in locked:
                short -= len(nd.pages) * ps
            nd = nd.parent
    return chosen if short <= 0 and slots_short <= 0 else []


def preempt(sched: Queues, adder: PrefillAdder | None, victims: Sequence[Req]) -> None:
    """Retract `victims` (running, or the carried chunk) back to the waiting queue; the adder, if
    any, gets their reservations and slots back."""
    for k, v in enumerate(victims):
        if adder is not None:
            adder.release(v)
        sched.retract(v, "preempted", at=k)
