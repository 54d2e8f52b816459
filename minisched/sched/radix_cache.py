"""Radix cache over whole KV pages (SGLang's RadixCache, page-aligned), with an optional host tier.

Keys are token-id lists cut to a multiple of `page_size`; each node holds a key segment and
where the K/V of its `len(key) / page_size` pages lives: `pages` (device page ids; empty when
the node is on the host only) and `host` (a host copy from host_tier.py, or None). Only full
pages are ever shared. The device-resident nodes form a subtree at the root (a node on the
device has its parent on the device), and only they are locked.

- `match_prefix(key) -> (pages, node)`: the longest page-aligned prefix cached on the device;
  splits a node when the match ends inside it. Refreshes LRU times on the path.
- `match_host(key, node)`: the host-only nodes that continue a device match (the host tier's
  hits); `load(nodes, pages)` gives them these device pages and returns the copies to run
  before the forward that reads them (`Batch.loads`).
- `insert(key, pages) -> duplicates`: adds the key; returns the pages of `pages` the caller must
  free because the tree already had those tokens on the device (a host-only node on the way
  adopts the new pages instead).
- `evict(n_pages) -> list[int]`: frees device pages of least recently used unlocked nodes that
  have no device child, until n_pages are released. With a host tier each goes to the host first
  (write-back; a copy only if it is not there yet) and stays in the tree; without one, or when the
  host is full even after its own LRU eviction, the node is dropped (with its host-only subtree).
- `inc_lock_ref(node)` / `dec_lock_ref(node)`: lock the path root..node for a live request,
  moving its size between `evictable_pages` and `protected_pages` (device pages only).
- `RadixCache(page_size, disable=True)`: matches nothing, stores nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from minisched.sched.host_tier import HostTier


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # device pages; [] when on the host only
    parent: TreeNode | None = None
    # first page of the child's key (tuple) -> node
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    host: Any = None  # the host copy (host tier), or None

    def on_device(self) -> bool:
        return bool(self.pages)

    def device_leaf(self) -> bool:
        return bool(self.pages) and not any(c.pages for c in self.children.values())


class CachedReq(Protocol):
    """What the request-KV methods use of a request (req.Req; req.py imports this module, not back)."""

    kv_len: int
    page_ids: list[int]
    n_cached_pages: int
    last_node: TreeNode | None

    @property
    def prompt_len(self) -> int: ...

    @property
    def fill_ids(self) -> list[int]: ...


class PagePool(Protocol):
    """What they use of the page pool (kv_pool.KVPool, which imports req.py)."""

    def free(self, pages: Iterable[int]) -> None: ...


class RadixCache:
    def __init__(
        self, page_size: int, disable: bool = False, host: HostTier | None = None, touch_split_tail: bool = False
    ) -> None:
        self.page_size = page_size
        self.disable = disable
        self.host = host
        # SGLang stamps a node it walks into before splitting it, so the tail a match or insert splits off
        # counts as used too (minisched: only the part on the key's path)
        self.touch_split_tail = touch_split_tail
        # and a request's cached sequence is split at its prompt's end, so eviction drops the decoded tail first
        self.split_at_prompt = touch_split_tail
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode(lock_ref=1)  # the root is never evicted
        self.evictable_pages = 0
        self.evicted_pages = 0  # device pages evicted so far (a counter: the decisions record per-step deltas)
        self.protected_pages = 0
        # lazy LRU heaps of (last_access, seq, node) candidates -- device eviction and host eviction;
        # stale entries (touched, locked, inner or removed nodes) are re-checked when popped
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._host_heap: list[tuple[int, int, TreeNode]] = []
        self._seq = itertools.count()
        self.pinned: set[int] = set()  # id() of host-only nodes a request is about to load: not dropped

    def _push(self, node: TreeNode, heap: list[tuple[int, int, TreeNode]] | None = None) -> None:
        heap = self._heap if heap is None else heap
        heapq.heappush(heap, (node.last_access, next(self._seq), node))
        if len(heap) > 2 * (self.total_pages + self.host_nodes) + 1024:  # drop stale entries now and then
            keep = TreeNode.device_leaf if heap is self._heap else (lambda nd: not nd.pages and not nd.children)
            heap[:] = [
                (nd.last_access, next(self._seq), nd) for nd in self.iter_nodes() if nd.lock_ref == 0 and keep(nd)
            ]
            heapq.heapify(heap)

    @property
    def total_pages(self) -> int:
        """Device pages held by the tree."""
        return self.evictable_pages + self.protected_pages

    @property
    def host_nodes(self) -> int:
        return 0 if self.host is None else self.host.used

    # -- helpers --------------------------------------------------------------
    def _page_key(self, key: list[int], i: int = 0) -> tuple[int, ...]:
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
        parent, host = node.parent, self.host
        assert parent is not None, "RadixCache: splitting a node not in the tree"
        if node.host is not None:
            assert host is not None, "RadixCache: a host copy without a host tier"
            upper.host, node.host = host.mover.split(node.host, npg)
        upper.children[self._page_key(node.key, n)] = node
        parent.children[self._page_key(node.key)] = upper
        node.key, node.pages, node.parent = node.key[n:], node.pages[npg:], upper
        return upper

    def _walk(self, key: list[int], n: int, node: TreeNode, pos: int, t: int, device: bool) -> Iterator[TreeNode]:
        """Follow key[pos:n] from `node` through device nodes (`device`) or host-only ones; yields them."""
        while pos < n:
            child = node.children.get(self._page_key(key, pos))
            if child is None or child.on_device() != device:
                return
            m = self._match_len(child.key, key, pos, n)
            if m < len(child.key):
                if self.touch_split_tail:
                    child.last_access = t
                child = self._split(child, m)
            child.last_access = t
            yield child
            node, pos = child, pos + m

    # -- public API -----------------------------------------------------------
    def match_prefix(self, key: list[int], max_len: int | None = None) -> tuple[list[int], TreeNode]:
        """Longest page-aligned prefix of key[:max_len] on the device: (its pages, its last node)."""
        if self.disable:
            return [], self.root
        n = len(key) if max_len is None else min(len(key), max_len)
        n -= n % self.page_size
        t = next(self._clock)
        self.root.last_access = t
        node, pages = self.root, []
        for node in self._walk(key, n, self.root, 0, t, device=True):
            pages.extend(node.pages)
        return pages, node

    def match_host(self, key: list[int], node: TreeNode, max_len: int | None = None) -> list[TreeNode]:
        """The host-only nodes continuing the device match that ended at `node` (depth = its length)."""
        if self.disable or self.host is None:
            return []
        depth, up = 0, node
        while up is not self.root:
            parent = up.parent
            assert parent is not None, "RadixCache: a match ending at a node not in the tree"
            depth, up = depth + len(up.key), parent
        n = len(key) if max_len is None else min(len(key), max_len)
        n -= n % self.page_size
        return list(self._walk(key, n, node, depth, next(self._clock), device=False))

    def load(self, nodes: list[TreeNode], pages: list[int]) -> list[tuple[Any, list[int]]]:
        """Give host-only `nodes` (a path, from `match_host`) these device pages; returns the copies
        (host copy, device pages) the forward must run first. The host copies stay (a later device
        eviction of these nodes then costs no copy)."""
        loads: list[tuple[Any, list[int]]] = []
        i, host = 0, self.host
        for nd in nodes:
            assert host is not None, "RadixCache: loading host nodes without a host tier"
            k = len(nd.key) // self.page_size
            nd.pages = pages[i : i + k]
            i += k
            loads.append((nd.host, nd.pages))
            self.evictable_pages += k
            self._push(nd)
            host.stats.loads += 1
            host.stats.load_pages += k
        return loads

    def insert(self, key: list[int], pages: list[int]) -> list[int]:
        """Insert a page-aligned key; returns the given pages that duplicate device pages already
        cached (the caller frees them)."""
        if self.disable:
            return []
        ps = self.page_size
        n = min(len(key) - len(key) % ps, len(pages) * ps)
        key = key[:n]
        node, pos = self.root, 0
        dup: list[int] = []
        t = next(self._clock)
        while pos < n:
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                new = TreeNode(key=key[pos:], pages=list(pages[pos // ps : n // ps]), parent=node, last_access=t)
                node.children[self._page_key(key, pos)] = new
                self.evictable_pages += len(new.pages)
                self._push(new)
                self._write_through(new)
                return dup
            m = self._match_len(child.key, key, pos, n)
            if m < len(child.key):
                if self.touch_split_tail:
                    child.last_access = t
                child = self._split(child, m)
            child.last_access = t
            given = list(pages[pos // ps : (pos + m) // ps])
            if child.on_device():
                dup += [g for g, have in zip(given, child.pages) if g != have]
            else:  # on the host only: it adopts the new pages (its parent is on the device: the path so far)
                child.pages = given
                self.evictable_pages += len(given)
                self._push(child)
            node, pos = child, pos + m
        return dup

    def _write_through(self, node: TreeNode) -> None:
        """The write-through policy: a new node is copied to the host at once (if it fits)."""
        host = self.host
        if host is not None and host.write_through and node.host is None and self._host_room(len(node.pages), node):
            node.host = host.mover.to_host(node.pages)
            host.take(len(node.pages))
            host.stats.write_backs += 1
            host.stats.write_back_pages += len(node.pages)

    def evict(self, n_pages: int) -> list[int]:
        """Free at least n_pages device pages if unlocked ones exist (see the module docstring)."""
        freed: list[int] = []
        heap = self._heap
        while heap and len(freed) < n_pages:
            t, _, node = heapq.heappop(heap)
            if node.parent is None or node.lock_ref or not node.device_leaf():
                continue  # removed, locked, inner or on the host only: pushed again when it qualifies
            if node.last_access != t:
                self._push(node)  # touched since it was pushed
                continue
            k = len(node.pages)
            freed.extend(node.pages)
            self.evictable_pages -= k
            self.evicted_pages += k
            parent = node.parent
            host = self.host
            if host is not None and (node.host is not None or self._host_room(k, node)):
                if node.host is None:  # write-back: copy it out before its pages are reused
                    node.host = host.mover.to_host(node.pages)
                    host.take(k)
                    host.stats.write_backs += 1
                    host.stats.write_back_pages += k
                else:
                    host.stats.kept += 1
                node.pages = []
                if not node.children:
                    self._push(node, self._host_heap)
            else:
                self._drop(node)
            if parent is not self.root and parent.lock_ref == 0 and parent.device_leaf():
                self._push(parent)
        return freed

    def flush(self) -> tuple[list[int], int]:
        """Drop every unlocked node for good, on the device and on the host (no write-back): (the
        device pages freed, the host pages dropped). A locked node's ancestors are locked too, so the
        unlocked nodes are whole subtrees under locked nodes or the root."""
        freed: list[int] = []
        dropped = self.host.stats.dropped_pages if self.host is not None else 0
        tops: list[TreeNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                (stack if child.lock_ref else tops).append(child)
        for top in tops:
            sub = [top]
            for nd in sub:  # (grows while read: the whole subtree)
                sub.extend(nd.children.values())
                freed.extend(nd.pages)
                self.evictable_pages -= len(nd.pages)
                nd.pages = []
            self._drop(top)
        if self.host is not None:
            dropped = self.host.stats.dropped_pages - dropped
        return freed, dropped

    def _host_room(self, k: int, keep: TreeNode) -> bool:
        """Make room for k pages on the host by its LRU eviction (never `keep` or its ancestors)."""
        host = self.host
        assert host is not None, "RadixCache: host room asked for without a host tier"
        if k > host.capacity:
            return False
        protect = set(self.pinned)
        up: TreeNode | None = keep
        while up is not None:
            protect.add(id(up))
            up = up.parent
        heap = self._host_heap
        skipped: list[TreeNode] = []
        while host.free < k and heap:
            t, _, node = heapq.heappop(heap)
            if node.parent is None or node.pages or node.children or node.host is None:
                continue
            if id(node) in protect:
                skipped.append(node)
                continue
            if node.last_access != t:
                self._push(node, heap)
                continue
            parent = node.parent
            self._drop(node)
            if parent is not self.root and not parent.pages and not parent.children:
                self._push(parent, heap)
        for node in skipped:
            self._push(node, heap)
        return host.free >= k

    def _drop(self, node: TreeNode) -> None:
        """Remove `node` (unlocked, no device pages left to keep) and its host-only subtree for good."""
        stack, host = [node], self.host
        while stack:
            nd = stack.pop()
            stack.extend(nd.children.values())
            if nd.host is not None:
                assert host is not None, "RadixCache: a host copy without a host tier"
                k = len(nd.key) // self.page_size
                host.give(k)
                host.mover.free(nd.host)
                host.stats.dropped_pages += k
                nd.host = None
        parent = node.parent
        assert parent is not None, "RadixCache: dropping a node not in the tree"
        del parent.children[self._page_key(node.key)]
        node.parent = None

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = self._up(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            if node.lock_ref <= 0:
                raise RuntimeError("RadixCache: unbalanced dec_lock_ref")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_leaf():
                self._push(node)
            node = self._up(node)

    @staticmethod
    def _up(node: TreeNode) -> TreeNode:
        """The parent of a node on a path below the root (every node but the root has one)."""
        parent = node.parent
        assert parent is not None, "RadixCache: a path leaves the tree"
        return parent

    # -- request KV (SGLang's cache_finished_req / cache_unfinished_req) --------
    def cache_finished_req(self, req: CachedReq, pool: PagePool) -> None:
        """A finished, aborted or retracted request gives up its KV: its full pages go into
        the tree (duplicates of already cached pages and the partial last page are freed),
        its lock is dropped, and its page table emptied."""
        if self.disable:
            pool.free(req.page_ids)
        else:
            n_full = req.kv_len // self.page_size
            pool.free(self.insert(req.fill_ids[: n_full * self.page_size], req.page_ids[:n_full]))
            self._split_at_prompt(req, n_full)
            pool.free(req.page_ids[n_full:])
            if req.last_node is not None:
                self.dec_lock_ref(req.last_node)
        req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = [], 0, None, 0

    def _split_at_prompt(self, req: CachedReq, n_full: int) -> None:
        """`split_at_prompt`: walk the request's prompt pages again (SGLang inserts them a second time: the
        walk's split and LRU stamps are all it changes), so the node holding prompt and decoded tokens is cut
        at the prompt's last full page."""
        k = req.prompt_len // self.page_size
        if self.split_at_prompt and 0 < k < n_full:
            self.match_prefix(req.fill_ids[: k * self.page_size])

    def release_req(self, req: CachedReq, pool: PagePool) -> None:
        """Like `cache_finished_req`, but nothing new goes into the tree (SGLang's retraction: the space is
        needed at once): the pages the tree does not hold already are freed, the lock dropped."""
        pool.free(req.page_ids[req.n_cached_pages :] if not self.disable else req.page_ids)
        if req.last_node is not None and not self.disable:
            self.dec_lock_ref(req.last_node)
        req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = [], 0, None, 0

    def cache_unfinished_req(self, req: CachedReq, pool: PagePool, kv_len: int | None = None) -> None:
        """After a prefill chunk: share the request's full pages through the tree, and move
        its lock to the deepest node (its page table now starts with the tree's pages).
        `kv_len`: share only this many tokens (overlap scheduling: later steps in flight
        have already advanced `req.kv_len` over pages not written yet)."""
        ps = self.page_size
        n_full = (req.kv_len if kv_len is None else kv_len) // ps
        if self.disable or n_full <= req.n_cached_pages:
            return
        key = req.fill_ids[: n_full * ps]
        pool.free(self.insert(key, req.page_ids[:n_full]))
        self._split_at_prompt(req, n_full)
        pages, node = self.match_prefix(key)
        req.page_ids[:n_full] = pages
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.n_cached_pages = node, n_full

    # -- inspection -----------------------------------------------------------
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        """Every device page the tree holds."""
        return [p for nd in self.iter_nodes() for p in nd.pages]

    def path_pages(self, node: TreeNode) -> list[int]:
        chunks: list[list[int]] = []
        while node is not self.root:
            chunks.append(node.pages)
            node = self._up(node)
        return [p for c in reversed(chunks) for p in c]

    def check(self, expected_locks: dict[int, int] | None = None) -> None:
        """Structural invariants, lock refs equal to `expected_locks` (id(node) -> count) when given,
        and the host tier's accounting; raises AssertionError."""
        ps, ev, pr, on_host = self.page_size, 0, 0, 0
        for nd in self.iter_nodes():
            k = len(nd.key) // ps
            assert nd.key and len(nd.key) == k * ps, f"node key of {len(nd.key)} tokens is not whole pages"
            assert len(nd.pages) in (0, k), f"node of {k} pages holds {len(nd.pages)} device pages"
            assert nd.pages or nd.host is not None, "a node neither on the device nor on the host"
            parent = nd.parent
            assert parent is not None, "a node in the tree without a parent"
            assert not nd.pages or parent is self.root or parent.pages, "a device node under a host-only one"
            assert parent.children.get(self._page_key(nd.key)) is nd, "child indexed under the wrong key"
            assert nd.lock_ref >= 0, "negative lock_ref"
            assert nd.pages or nd.lock_ref == 0, "a host-only node is locked"
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
            on_host += k if nd.host is not None else 0
        assert (ev, pr) == (self.evictable_pages, self.protected_pages), (
            f"size accounting: counted evictable/protected {ev}/{pr}, recorded {self.evictable_pages}/{self.protected_pages}"
        )
        if self.host is not None:
            assert on_host == self.host.used <= self.host.capacity, (
                f"host tier: nodes hold {on_host} pages, accounted {self.host.used} of {self.host.capacity}"
            )
