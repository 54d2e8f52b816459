"""Request routing for data parallelism: which engine replica serves a prompt (pure Python, no processes).

    router = Router(RouterConfig(policy="cache-aware"), num_replicas=2, chunk=16, max_tree_tokens=4096)
    i = router.route(prompt_ids)      # picks a replica and counts the request as its load
    router.done(i)                    # the request finished (or failed): its load drops
    router.remove(i)                  # the replica died: never routed to again

`cache-aware` is SGLang's router policy (sgl-router `cache_aware`): the router keeps, per
replica, an approximate prefix tree of the prompts it sent there -- approximate because the
replica's own radix cache evicts on its own, which the router never learns. A prompt goes to
the replica whose tree matches its longest prefix when that match covers more than
`cache_threshold` of the prompt; otherwise to the replica with the smallest tree (the most
room left for a new prefix). Load wins over cache affinity when the system is imbalanced:
`max_load - min_load > balance_abs_threshold` AND `max_load > balance_rel_threshold * min_load`
(load = requests routed and not yet done), then the least-loaded replica gets it. Either
way the prompt is inserted into the chosen replica's tree.

The tree works in chunks of `chunk` tokens (the engine's page size): the engine's radix cache
holds whole pages only, so a partial last page would never be a hit there either. Each tree
is bounded by `max_tree_tokens` (default: the replica's KV pool); past it, least recently
used leaves go first, as in the engine's cache.

`round-robin` ignores prompts and load: the baseline for the benchmark.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from minisched.base.flags import flag

POLICIES = ("cache-aware", "round-robin")


class NoReplicaError(RuntimeError):
    """Every replica is gone: nothing can serve the request."""


@dataclass(frozen=True)
class RouterConfig:
    # Defaults: SGLang's CacheAwareConfig (sgl-router policies/mod.rs). The flags: `minisched serve --router ...`
    policy: str = flag(
        "cache-aware",
        "how --dp routes a request: to the replica caching its longest prefix, or in turn",
        name="--router",
        choices=POLICIES,
    )
    cache_threshold: float = flag(
        0.5, "cache-aware: the prefix match (share of the prompt) above which it wins over a fresh replica"
    )
    balance_abs_threshold: int = flag(
        32, "cache-aware: route by load when max - min in-flight requests exceeds this ..."
    )
    balance_rel_threshold: float = flag(1.1, "... and max exceeds this times min")

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")


class _Node:
    __slots__ = ("children", "parent", "key", "last_used")

    def __init__(self, parent: Optional[_Node], key: tuple, last_used: int):
        self.children: dict[tuple, _Node] = {}
        self.parent, self.key, self.last_used = parent, key, last_used


class PrefixTree:
    """A trie over chunks of token ids: what one replica was sent, bounded, LRU-evicted by leaves."""

    def __init__(self, chunk: int, max_tokens: int):
        if chunk < 1 or max_tokens < chunk:
            raise ValueError(f"need chunk >= 1 and max_tokens >= chunk, got chunk={chunk}, max_tokens={max_tokens}")
        self.chunk, self.max_nodes = chunk, max_tokens // chunk
        self.root = _Node(None, (), 0)
        self.num_nodes = 0
        self._clock = itertools.count(1)

    @property
    def num_tokens(self) -> int:
        return self.num_nodes * self.chunk

    def _chunks(self, ids: Sequence[int]):
        c = self.chunk
        return (tuple(ids[i : i + c]) for i in range(0, len(ids) - c + 1, c))

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of the longest prefix of `ids` in the tree (a multiple of the chunk)."""
        node, n = self.root, 0
        for key in self._chunks(ids):
            child = node.children.get(key)
            if child is None:
                break
            node, n = child, n + self.chunk
        return n

    def insert(self, ids: Sequence[int]) -> None:
        """Add `ids` (whole chunks) and mark its path used now; evict LRU leaves past the bound."""
        now = next(self._clock)
        node = self.root
        for key in self._chunks(ids):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key, now)
                self.num_nodes += 1
            child.last_used = now
            node = child
        if self.num_nodes > self.max_nodes:
            self._evict(self.num_nodes - self.max_nodes, keep=node)

    def _evict(self, n: int, keep: _Node) -> None:
        # The path just inserted is the newest, so it goes last; `keep` guards it when one prompt
        # alone is longer than the bound (then its tail is what stays out).
        protected = set()
        p: Optional[_Node] = keep
        while p is not None:
            protected.add(id(p))
            p = p.parent
        heap = [(leaf.last_used, id(leaf), leaf) for leaf in self._leaves() if id(leaf) not in protected]
        heapq.heapify(heap)
        while n > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key]
            self.num_nodes -= 1
            n -= 1
            if parent is not self.root and not parent.children and id(parent) not in protected:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def clear(self) -> None:
        self.root.children.clear()
        self.num_nodes = 0


class Router:
    """Chooses a replica per request. Not thread-safe: the caller serializes (one event loop, or a lock)."""

    def __init__(self, config: RouterConfig, num_replicas: int, *, chunk: int = 16, max_tree_tokens: int = 1 << 16):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.config = config
        self.trees = [PrefixTree(chunk, max_tree_tokens) for _ in range(num_replicas)]
        self.load = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.routed = [0] * num_replicas
        self._rr = itertools.count()

    def live(self) -> list[int]:
        return [i for i, ok in enumerate(self.alive) if ok]

    def route(self, prompt_ids: Sequence[int]) -> int:
        live = self.live()
        if not live:
            raise NoReplicaError("no engine replica is alive")
        if self.config.policy == "round-robin":
            pick = live[next(self._rr) % len(live)]
        else:
            pick = self._cache_aware(prompt_ids, live)
            self.trees[pick].insert(prompt_ids)
        self.load[pick] += 1
        self.routed[pick] += 1
        return pick

    def imbalanced(self, live: Optional[list[int]] = None) -> bool:
        loads = [self.load[i] for i in (self.live() if live is None else live)]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.config.balance_abs_threshold and hi > self.config.balance_rel_threshold * lo

    def _cache_aware(self, ids: Sequence[int], live: list[int]) -> int:
        least_loaded = min(live, key=lambda i: (self.load[i], i))
        if self.imbalanced(live):
            return least_loaded
        matched = {i: self.trees[i].match(ids) for i in live}
        best = max(live, key=lambda i: (matched[i], -self.load[i], -i))
        if ids and matched[best] / len(ids) > self.config.cache_threshold:
            return best
        return min(live, key=lambda i: (self.trees[i].num_nodes, self.load[i], i))

    def done(self, i: int) -> None:
        self.load[i] = max(0, self.load[i] - 1)

    def remove(self, i: int) -> None:
        self.alive[i] = False
        self.load[i] = 0
        self.trees[i].clear()

    def add(self, i: int) -> None:
        """Replica i serves again (restarted): routable, with an empty tree like its cache."""
        self.alive[i] = True
        self.load[i] = 0
        self.trees[i].clear()

    def reset(self) -> None:
        """Forget every tree (the replicas' caches were flushed)."""
        for t in self.trees:
            t.clear()
