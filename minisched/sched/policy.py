"""Scheduling policies: the order in which waiting requests are offered to the PrefillAdder.

- `fcfs`: queue order (retracted requests sit at the head of the queue).
- `lpm`: longest cached prefix first (radix `match_prefix` of each waiting request);
  plain FCFS when more than `lpm_fallback_len` (128) requests wait or the cache is off.
- `dfs-weight`: depth-first over the radix tree, heavier subtrees (more waiting
  requests below) first, so requests sharing a prefix run together. Like LPM it
  matches every waiting request, so it also falls back to FCFS beyond `lpm_fallback_len`
  (SGLang: only LPM does, `dfs_weight_fallback=False`); equally heavy subtrees go newest
  first (SGLang: in insertion order, `dfs_ties_reversed=False`).
- `lof`: longest output (max_new_tokens) first.

Aging (the cache-aware policies, LPM and DFS-weight): a request that has been overtaken
(a later arrival admitted while it waited) in `aging_rounds` prefill rounds goes before
all others, oldest first. So a cache-cold request cannot be starved by a stream of
cache-hot ones: it is overtaken at most `aging_rounds` times. Counting overtakes rather
than elapsed steps keeps LPM intact while a full decode batch makes everyone wait.
Sorts are stable, so ties keep queue order. SGLang 0.5.23 (`order_sglang`) sorts the queue in
place, so ties keep the last round's order, and has no aging.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisched.sched.radix_cache import RadixCache, TreeNode
from minisched.sched.req import Req

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")


def take_admitted(waiting: list[Req], admitted: list[Req], aging: bool) -> list[Req]:
    """The waiting queue without the admitted requests; with `aging`, every request that a later
    arrival overtook counts one more overtake."""
    k = len(admitted)
    if all(a is w for a, w in zip(admitted, waiting[:k])):  # FCFS: a prefix
        rest = waiting[k:]
    else:
        ids = {id(r) for r in admitted}
        rest = [r for r in waiting if id(r) not in ids]
    if aging and admitted:
        newest = max(r.arrival_seq for r in admitted)
        for r in rest:
            if r.arrival_seq < newest:
                r.overtaken += 1
    return rest


@dataclass
class SchedulePolicy:
    name: str
    tree: RadixCache
    lpm_fallback_len: int = 128
    aging_rounds: int | None = 32  # None: no aging
    dfs_weight_fallback: bool = True  # dfs-weight falls back to FCFS like LPM (SGLang: only LPM)
    dfs_ties_reversed: bool = True  # equally heavy subtrees: newest child first (SGLang: insertion order)
    sglang_sort: bool = False  # SGLang's calc_priority (see `order_sglang`)
    deprioritize_tokens: int | None = None  # SGLang's in-batch prefix rule (LPM: sorted last); None: off
    _refreshes: int = 0

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose one of {POLICIES}")

    def active(self, n_waiting: int) -> str:
        fallback = ("lpm", "dfs-weight") if self.dfs_weight_fallback else ("lpm",)
        if self.name in ("lpm", "dfs-weight") and self.tree.disable:
            return "fcfs"
        if self.name in fallback and n_waiting > self.lpm_fallback_len:
            return "fcfs"
        return self.name

    def order_sglang(self, waiting: list[Req]) -> list[Req]:
        """SGLang 0.5.23's calc_priority: the caller keeps the returned order as the queue's. The cache-aware
        policies match each request's whole sequence (LPM ranks by the match clipped to seq_len - 1, DFS goes
        by the node the match ends at); with `deprioritize_tokens`, a request whose cached prefix is at most
        that long and that shares at least that many tokens with an earlier such request goes to the end of
        an LPM queue. FCFS and LOF touch the waiting prefixes' LRU times every 32nd round, head last."""
        name = self.active(len(waiting))
        if name in ("fcfs", "lof"):
            ordered = waiting if name == "fcfs" else sorted(waiting, key=lambda r: -r.sampling.max_new_tokens)
            refresh = self._refreshes % 32 == 0
            self._refreshes += 1
            if refresh and not self.tree.disable:
                for r in reversed(ordered[:128]):
                    self.tree.match_prefix(r.fill_ids if r.output_ids else r.prompt_ids)
            return ordered
        ps = self.tree.page_size
        cached: dict[int, int] = {}
        matched: dict[int, int] = {}
        nodes: dict[int, TreeNode] = {}
        for r in waiting:
            pages, node = self.tree.match_prefix(r.fill_ids if r.output_ids else r.prompt_ids)
            cached[id(r)] = len(pages) * ps
            matched[id(r)], nodes[id(r)] = min(cached[id(r)], r.seq_len - 1), node
        late = self._sharing_uncached(waiting, cached)
        if name == "lpm":
            return sorted(waiting, key=lambda r: float("inf") if id(r) in late else -matched[id(r)])
        return self._dfs_weight(waiting, nodes)

    def _sharing_uncached(self, waiting: list[Req], cached: dict[int, int]) -> set[int]:
        """SGLang's in-batch prefix rule (`deprioritize_tokens`; empty when None): ids of the requests with at most
        that many cached tokens (`cached`: id -> tokens) that share at least that many with an earlier such one."""
        limit = self.deprioritize_tokens
        if limit is None:
            return set()
        seen, late = RadixCache(1), set()
        for r in waiting:
            if cached[id(r)] > limit:
                continue
            key = r.fill_ids if r.output_ids else r.prompt_ids
            if len(seen.match_prefix(key)[0]) >= limit:
                late.add(id(r))
            else:
                seen.insert(key, [0] * len(key))
        return late

    def order(self, waiting: list[Req]) -> list[Req]:
        """Return the waiting requests in admission order (does not modify `waiting`)."""
        if self.sglang_sort:
            return self.order_sglang(waiting)
        name = self.active(len(waiting))
        if name == "fcfs":
            return waiting
        if name == "lpm":
            ps = self.tree.page_size
            cached = {id(r): len(self._match(r)[0]) * ps for r in waiting}
            late = self._sharing_uncached(waiting, cached)  # (in_batch_prefix_rule="sglang"): sorted last
            keyed = [(id(r) in late, -cached[id(r)], i, r) for i, r in enumerate(waiting)]
            ordered = [r for *_, r in sorted(keyed, key=lambda x: x[:3])]
        elif name == "lof":
            ordered = sorted(waiting, key=lambda r: -r.sampling.max_new_tokens)
        else:
            ordered = self._dfs_weight(waiting)
        if name == "lof" or self.aging_rounds is None:
            return ordered
        aged = [r for r in waiting if r.overtaken >= self.aging_rounds]
        if not aged:
            return ordered
        aged.sort(key=lambda r: r.arrival_seq)
        aged_ids = {id(r) for r in aged}
        return aged + [r for r in ordered if id(r) not in aged_ids]

    def _match(self, r: Req) -> tuple[list[int], TreeNode]:
        return self.tree.match_prefix(r.fill_ids if r.output_ids else r.prompt_ids, r.seq_len - 1)

    def _dfs_weight(self, waiting: list[Req], matched: dict[int, TreeNode] | None = None) -> list[Req]:
        """`matched`: id(request) -> the node its match ended at (default: match each now)."""
        at_node: dict[int, list[Req]] = {}
        nodes: dict[int, TreeNode] = {}
        for r in waiting:
            node = self._match(r)[1] if matched is None else matched[id(r)]
            at_node.setdefault(id(node), []).append(r)
            nodes[id(node)] = node
        weight: dict[int, int] = {}
        for nid, reqs in at_node.items():  # add each request's weight to its node's ancestors
            up: TreeNode | None = nodes[nid]
            while up is not None:
                weight[id(up)] = weight.get(id(up), 0) + len(reqs)
                up = up.parent
        out: list[Req] = []
        stack = [(self.tree.root, False)]
        while stack:  # post-order (SGLang): heavier children first, then the node's own requests
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(id(node), ()))
                continue
            stack.append((node, True))
            kids = [c for c in node.children.values() if id(c) in weight]
            if self.dfs_ties_reversed:
                kids.sort(key=lambda c: weight[id(c)])  # the heaviest is pushed last, popped first
            else:  # heaviest first, ties in the children's insertion order
                kids.sort(key=lambda c: -weight[id(c)])
                kids.reverse()
            stack.extend((c, False) for c in kids)
        return out
