"""Radix cache over whole KV pages (SGLang's RadixCache, page-aligned).

Keys are token-id lists cut to a multiple of `page_size`; each node holds a key
segment and the pages whose K/V belong to it (`len(key) == len(pages) * page_size`),
so only full pages are ever shared and no copy-on-write is needed.

- `match_prefix(key) -> (pages, node)`: the longest cached page-aligned prefix;
  splits a node when the match ends inside it. Refreshes LRU times on the path.
- `insert(key, pages) -> n_cached_tokens`: adds the key; returns how many leading
  tokens were already cached, whose pages in `pages` are duplicates the caller frees.
- `evict(n_pages) -> list[int]`: frees least recently used unlocked leaves (cascading
  up to parents that become leaves) until n_pages are released; the caller returns
  them to the pool.
- `inc_lock_ref(node)` / `dec_lock_ref(node)`: lock the path root..node for a live
  request, moving its size between `evictable_pages` and `protected_pages`.
- `RadixCache(page_size, disable=True)`: matches nothing, stores nothing.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict = field(default_factory=dict)  # first page of the child's key (tuple) -> node
    lock_ref: int = 0
    last_access: int = 0


class RadixCache:
    def __init__(self, page_size: int, disable: bool = False) -> None:
        self.page_size = page_size
        self.disable = disable
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode(lock_ref=1)  # the root is never evicted
        self.evictable_pages = 0
        self.protected_pages = 0
        # lazy LRU heap of (last_access, seq, node) eviction candidates; stale entries
        # (touched, locked, inner or removed nodes) are re-checked when popped
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self.total_pages + 1024:  # drop stale entries now and then
            self._heap = [
                (nd.last_access, next(self._seq), nd)
                for nd in self._iter_nodes()
                if not nd.children and nd.lock_ref == 0
            ]
            heapq.heapify(self._heap)

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    # -- helpers --------------------------------------------------------------
    def _page_key(self, key: list[int], i: int = 0) -> tuple:
        return tuple(key[i : i + self.page_size])

    def _match_len(self, a: list[int], b: list[int], start: int, end: int) -> int:
        """Page-aligned length of the common prefix of a and b[start:end]."""
        ps, n, i = self.page_size, min(len(a), end - start), 0
        if n == len(a) and b[start : start + n] == a:
            return n - n % ps
        while i < n and a[i : i + ps] == b[start + i : start + i + ps]:
            i += ps
        return min(i, n - n % ps)

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split `node` after its first n tokens; returns the new upper node."""
        npg = n // self.page_size
        upper = TreeNode(
            key=node.key[:n],
            pages=node.pages[:npg],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        upper.children[self._page_key(node.key, n)] = node
        node.parent.children[self._page_key(node.key)] = upper
        node.key, node.pages, node.parent = node.key[n:], node.pages[npg:], upper
        return upper

    # -- public API -----------------------------------------------------------
    def match_prefix(self, key: list[int], max_len: int | None = None) -> tuple[list[int], TreeNode]:
        """Longest cached page-aligned prefix of key[:max_len]: (its pages, its last node)."""
        if self.disable:
            return [], self.root
        n = len(key) if max_len is None else min(len(key), max_len)
        n -= n % self.page_size
        node, pos, pages = self.root, 0, []
        t = next(self._clock)
        node.last_access = t
        while pos < n:
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                break
            m = self._match_len(child.key, key, pos, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = t
            pages.extend(child.pages)
            node, pos = child, pos + m
        return pages, node

    def insert(self, key: list[int], pages: list[int]) -> int:
        """Insert a page-aligned key; returns the number of tokens already cached."""
        if self.disable:
            return 0
        ps = self.page_size
        n = min(len(key) - len(key) % ps, len(pages) * ps)
        key = key[:n]
        node, pos = self.root, 0
        t = next(self._clock)
        while pos < n:
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                new = TreeNode(key=key[pos:], pages=list(pages[pos // ps : n // ps]), parent=node, last_access=t)
                node.children[self._page_key(key, pos)] = new
                self.evictable_pages += len(new.pages)
                self._push(new)
                return pos
            m = self._match_len(child.key, key, pos, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = t
            node, pos = child, pos + m
        return pos

    def evict(self, n_pages: int) -> list[int]:
        freed: list[int] = []
        heap = self._heap
        while heap and len(freed) < n_pages:
            t, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_ref:
                continue  # removed, inner or locked: pushed again when it becomes a free leaf
            if node.last_access != t:
                self._push(node)  # touched since it was pushed
                continue
            freed.extend(node.pages)
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            del parent.children[self._page_key(node.key)]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            if node.lock_ref <= 0:
                raise RuntimeError("RadixCache: unbalanced dec_lock_ref")
            node.lock_ref -= 1
            if node.lock_ref == 0 and not node.children:
                self._push(node)
            node = node.parent

    # -- request KV (SGLang's cache_finished_req / cache_unfinished_req) --------
    def cache_finished_req(self, req, pool) -> None:
        """A finished, aborted or retracted request gives up its KV: its full pages go into
        the tree (duplicates of already cached pages and the partial last page are freed),
        its lock is dropped, and its page table emptied."""
        if self.disable:
            pool.free(req.page_ids)
        else:
            n_full = req.kv_len // self.page_size
            already = self.insert(req.fill_ids[: n_full * self.page_size], req.page_ids[:n_full])
            pool.free(req.page_ids[req.n_cached_pages : already // self.page_size])
            pool.free(req.page_ids[n_full:])
            if req.last_node is not None:
                self.dec_lock_ref(req.last_node)
        req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = [], 0, None, 0

    def cache_unfinished_req(self, req, pool, kv_len: int | None = None) -> None:
        """After a prefill chunk: share the request's full pages through the tree, and move
        its lock to the deepest node (its page table now starts with the tree's pages).
        `kv_len`: share only this many tokens (overlap scheduling: later steps in flight
        have already advanced `req.kv_len` over pages not written yet)."""
        ps = self.page_size
        n_full = (req.kv_len if kv_len is None else kv_len) // ps
        if self.disable or n_full <= req.n_cached_pages:
            return
        key = req.fill_ids[: n_full * ps]
        already = self.insert(key, req.page_ids[:n_full])
        pool.free(req.page_ids[req.n_cached_pages : already // ps])
        pages, node = self.match_prefix(key)
        req.page_ids[:n_full] = pages
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.n_cached_pages = node, n_full

    # -- inspection -----------------------------------------------------------
    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        return [p for nd in self._iter_nodes() for p in nd.pages]

    def path_pages(self, node: TreeNode) -> list[int]:
        chunks = []
        while node is not self.root:
            chunks.append(node.pages)
            node = node.parent
        return [p for c in reversed(chunks) for p in c]

    def check(self, expected_locks: dict[int, int] | None = None) -> None:
        """Structural invariants, and lock refs equal to `expected_locks` (id(node) -> count)
        when given; raises AssertionError."""
        ps, ev, pr = self.page_size, 0, 0
        for nd in self._iter_nodes():
            assert nd.key and len(nd.key) == len(nd.pages) * ps, (
                f"node key/pages mismatch {len(nd.key)} vs {len(nd.pages)}"
            )
            assert nd.parent.children.get(self._page_key(nd.key)) is nd, "child indexed under the wrong key"
            assert nd.lock_ref >= 0, "negative lock_ref"
            if expected_locks is not None:
                assert nd.lock_ref == expected_locks.get(id(nd), 0), (
                    f"lock_ref {nd.lock_ref} != {expected_locks.get(id(nd), 0)} live requests locking the node"
                )
            assert nd.lock_ref >= max((c.lock_ref for c in nd.children.values()), default=0), (
                "child locked more than parent"
            )
            if nd.lock_ref:
                pr += len(nd.pages)
            else:
                ev += len(nd.pages)
        assert (ev, pr) == (self.evictable_pages, self.protected_pages), (
            f"size accounting: counted evictable/protected {ev}/{pr}, recorded {self.evictable_pages}/{self.protected_pages}"
        )
