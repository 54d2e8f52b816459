"""The scheduler's invariants, checked between steps (tests call them after every step).

- free + cached + held pages == total, each page owned exactly once;
- each radix node's lock count == the live requests whose prefix passes through it;
- each live request sits in exactly the queue its status names (waiting, running, the
  carried chunk), and its token counts and page table agree with that state (`Req.check`);
- a batch may be launched (its tokens pending); the requests held back at their length limit
  (`in_flight.limbo`) are live too, and only launched batches' rows have placeholders.

Pure Python; raises AssertionError.
"""

from __future__ import annotations

from minisched.base.values import cdiv
from minisched.sched.queues import Queues
from minisched.sched.radix_cache import TreeNode
from minisched.sched.req import Place, ReqStatus


def check_scheduler(sched: Queues) -> None:
    flight = sched.in_flight
    assert flight.built is None, "check_invariants called with a batch built but not launched"
    assert not flight.aborted, "aborts pending with no batch built"
    tree, cfg = sched.tree, sched.config
    queues = [
        (sched.waiting, ReqStatus.WAITING, Place.WAITING),
        (sched.running, ReqStatus.RUNNING, Place.RUNNING),
        ([sched.chunked_req] if sched.chunked_req else [], ReqStatus.PREFILLING, Place.CHUNKED),
        (flight.limbo, None, Place.LIMBO),
    ]
    assert sorted(id(r) for q, _, _ in queues for r in q) == sorted(map(id, sched.reqs.values())), (
        "live requests != waiting + running + chunked + limbo"
    )
    futures = flight.future_ids()
    locks: dict[int, int] = {}
    held: list[int] = []
    for queue, status, place in queues:
        for r in queue:
            assert r.place is place, f"{r.rid}: place {r.place} in the {place.value} queue"
            assert all(f in futures for f in r.pending_ids), f"{r.rid}: a placeholder no launched batch computes"
            if status is None:  # limbo: a finished prompt or a token at the length limit is being computed
                assert r.status in (ReqStatus.RUNNING, ReqStatus.PREFILLING), f"{r.rid}: {r.status} in limbo"
                assert len(r.page_ids) == cdiv(r.kv_len, cfg.page_size), f"{r.rid}: pages != kv_len"
            else:
                assert r.status is status, f"{r.rid}: status {r.status} in the {status.value} queue"
                r.check(cfg.page_size, sched.max_context_len)
            if r.last_node is not None:
                assert tree.path_pages(r.last_node) == r.page_ids[: r.n_cached_pages], f"{r.rid}: prefix != tree"
                node: TreeNode | None = r.last_node
                while node is not tree.root:
                    assert node is not None, f"{r.rid}: its locked path leaves the radix tree"
                    locks[id(node)] = locks.get(id(node), 0) + 1
                    node = node.parent
            held.extend(r.page_ids[r.n_cached_pages :])
    tree.check(locks)
    pending = [p for b in flight.launched for p in b.free_after]  # copy sources of launched batches
    sched.pool.check_partition(tree.all_pages(), held + sched.forks.pages() + pending)
