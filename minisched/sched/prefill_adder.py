"""PrefillAdder: admits waiting requests into one prefill batch under token budgets.

Budgets (tokens), as in SGLang's schedule_policy.PrefillAdder:

- input: `max_prefill_tokens` new tokens per batch; the first request may exceed it (SGLang checks a
  request against it only without chunking: `max_prefill_tokens_with_chunking=False`);
- chunk: `chunk_size` new tokens per batch; a request whose remaining prompt does not
  fit runs its first (page-aligned) part and is carried to the next round
  (`new_chunked_req`), where `add_chunked_req` puts it first;
- total: `(free + evictable pages) * page_size - reserved`, where `reserved` sums the
  future decode tokens (`min(remaining max_new_tokens, clip_estimate) * new_token_ratio`)
  of running and admitted requests; the clip (SGLang's CLIP_MAX_NEW_TOKENS) keeps one
  huge request from reserving the whole pool. When nothing runs and nothing is admitted
  yet, the first request is admitted as long as its pages fit at all, so a small pool
  never deadlocks. SGLang 0.5.23's budget differs (`admission_budget="sglang"`, the
  `*_sglang` methods): new requests reserve in full, the whole remaining prompt plus a page
  is checked with `<`, no first-request exemption, pages allocated after selection.
- mixed: `mixed_decode_tokens` decode rows ride along with this batch, so they come off
  the input and chunk budgets first (a mixed batch never exceeds `chunk_size`).

`defer` (deferral.py): a request sharing a long uncached prefix with one already in the
batch is skipped (DEFERRED) and runs next round with a cache hit.

Each admitted request gets its radix prefix (locked) and its new pages here, evicting
the cache when the free list is short, so what was admitted can run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minisched.base.values import cdiv
from minisched.sched.deferral import InBatchPrefixes
from minisched.sched.forks import ForkPages
from minisched.sched.kv_pool import KVPool
from minisched.sched.radix_cache import RadixCache, TreeNode
from minisched.sched.req import Req


class AddResult(enum.Enum):
    CONTINUE = "continue"  # admitted; try the next request
    DEFERRED = "deferred"  # skipped this round (in-batch prefix); try the next request
    NO_TOKEN = "no_token"  # out of KV budget; stop
    OTHER = "other"  # batch full (input/chunk/request budget); stop


@dataclass(kw_only=True)
class PrefillAdder:
    pool: KVPool
    tree: RadixCache
    new_token_ratio: float
    rem_input_tokens: int
    rem_chunk_tokens: int | None  # None: chunking disabled
    max_new_reqs: int
    running: list[Req]
    clip_estimate: int = 4096
    mixed_decode_tokens: int = 0
    defer: InBatchPrefixes | None = None
    reserved: float = 0.0
    can_run: list[Req] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    new_chunked_req: Req | None = None
    cache_hit_tokens: int = 0
    loads: list = field(default_factory=list)  # (host copy, device pages) to run before the forward
    forks: ForkPages | None = None  # n > 1: the prompts' kept last pages (forks.py)
    copies: list = field(default_factory=list)  # (source page, page) copies to run before the forward
    free_after: list = field(default_factory=list)  # pages to free once the batch has run (copy sources)
    sources: set = field(default_factory=set)  # copy sources of this batch: neither reclaimed nor evicted
    # radix nodes holding such sources, locked until `finish`
    source_nodes: list[TreeNode] = field(default_factory=list)
    blocked: Req | None = None  # the request that stopped the last add_waiting without being admitted
    blocked_result: AddResult | None = None  # and why
    prefix_deferred: list[Req] = field(default_factory=list)  # skipped for the in-batch prefix, in order
    # admission_budget="sglang" (SGLang 0.5.23's PrefillAdder; see `add_one_req_sglang`)
    sglang: bool = False
    chunk_floor: bool = False  # chunk_rule="sglang": a new chunk is floored to a page, refused if that is 0
    input_check_with_chunking: bool = True  # max_prefill_tokens_with_chunking
    conservative_eviction: bool = False  # paged: evict for a new page per row beyond what it allocates
    current_offset: int = 0  # sglang: tokens charged to this batch's allocation (extend pages + a page per row)
    deferred: list = field(default_factory=list)  # sglang: (request, tokens) allocated by `allocate_deferred`
    full: bool | None = None  # sglang: set when slots or KV ran out (the scheduler's batch_is_full), else None

    def __post_init__(self) -> None:
        clip = self.clip_estimate
        self.reserved += sum(min(r.remaining_new_tokens, clip) for r in self.running) * self.new_token_ratio
        self.rem_input_tokens -= self.mixed_decode_tokens
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= self.mixed_decode_tokens

    def reserved_for(self, req: Req) -> float:
        """The future decode tokens reserved for `req` (its remaining tokens, clipped, times the ratio)."""
        return min(req.remaining_new_tokens, self.clip_estimate) * self.new_token_ratio

    @property
    def rem_total_tokens(self) -> float:
        return (self.pool.num_free + self.tree.evictable_pages + self._kept()) * self.pool.page_size - self.reserved

    def _kept(self) -> int:
        """Kept fork pages `_make_room` may reclaim (not this batch's copy sources)."""
        return sum(p not in self.sources for p in self.forks.pages()) if self.forks is not None else 0

    def finish(self) -> None:
        """The batch is built: the radix pages it copies from may be evicted again (any later writer of such
        a page runs after this batch's copies, which come first in its forward)."""
        for node in self.source_nodes:
            self.tree.dec_lock_ref(node)
        self.source_nodes.clear()

    def _fork_source(self, req: Req, key: list[int], prefix: int) -> tuple[int, TreeNode | None] | None:
        """For an n > 1 choice's first admission: the page holding its prompt's last page and the radix node
        holding it (the leader's kept partial page: None, or the radix cache's last full page) when copying
        it saves at least one token."""
        ps, n = self.pool.page_size, req.prompt_len
        if self.forks is None or req.after is None or req.forked or req.output_ids or ps == 1 or n % ps == 1:
            return None
        if n % ps:
            page = self.forks.source(req) if prefix == n - n % ps else None
            return None if page is None else (page, None)
        if prefix == n - ps:
            last, node = self.tree.match_prefix(key, n)
            if len(last) * ps == n:
                return last[-1], node
        return None

    def _use_source(self, source: tuple[int, TreeNode | None] | None) -> None:
        """Protect a copy source from the evictions and reclaims of this batch's allocations."""
        if source is not None:
            self.sources.add(source[0])
            if source[1] is not None:
                self.tree.inc_lock_ref(source[1])
                self.source_nodes.append(source[1])

    def _drop_source(self, source: tuple[int, TreeNode | None] | None) -> None:
        if source is not None:
            if not any(src == source[0] for src, _ in self.copies):
                self.sources.discard(source[0])
            if source[1] is not None:
                self.tree.dec_lock_ref(source[1])
                self.source_nodes.remove(source[1])

    def _no_room(self, req: Req, source: tuple[int, TreeNode | None] | None) -> AddResult:
        """Out of KV budget; a choice that would have copied its last page tries again without the copy (its
        source may then be reclaimed)."""
        if source is None:
            return AddResult.NO_TOKEN
        self._drop_source(source)
        return self.add_one_req(req, copy=False)

    def _make_room(self, need: int) -> None:
        """Free pages for `need`: evict the radix cache, then give back the pages kept for forks."""
        if need > self.pool.num_free:
            self.pool.free(self.tree.evict(need - self.pool.num_free))
        if need > self.pool.num_free and self.forks is not None:
            self.forks.reclaim(keep=self.sources)

    def _alloc_pages(self, n: int) -> list[int] | None:
        self._make_room(n)
        return self.pool.alloc(n)

    def _alloc(self, req: Req, n_tokens: int, spare: int = 0) -> bool:
        """Pages for `n_tokens` more of `req`, evicting room for `spare` more pages too."""
        self._make_room(self.pool.pages_needed(req, n_tokens) + spare)
        return self.pool.alloc_for_extend(req, n_tokens)

    def _spare(self) -> int:
        """conservative_eviction, minisched's admission: SGLang's paged extend evicts a page per row beyond need."""
        return int(self.conservative_eviction and self.pool.page_size > 1)

    def chunk_len(self, extend: int) -> tuple[int, bool]:
        """New tokens to run this round and whether the request is truncated (0 tokens: refused, chunk_floor)."""
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            return extend, False
        ps = self.pool.page_size
        n = self.rem_chunk_tokens - self.rem_chunk_tokens % ps
        return (n if n > 0 or self.chunk_floor else self.rem_chunk_tokens), True

    # -- admission_budget="sglang" ----------------------------------------------
    def _available_tokens(self) -> int:
        return (self.pool.num_free + self.tree.evictable_pages + self._kept()) * self.pool.page_size

    def budget_state(self) -> AddResult:
        """SGLang's budget_state: NO_TOKEN once the KV budget is spent, OTHER once the input or chunk budget is."""
        avail = self._available_tokens()
        if avail - self.reserved <= 0 or avail - self.current_offset <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def _charge(self, req: Req, prefix: int, n: int, truncated: bool) -> None:
        """Admit with SGLang's charges: the page-ceiled extend plus a page of overhead, and (unless truncated)
        min(max_new_tokens, clip) future tokens in full; pages come later (`allocate_deferred`)."""
        ps = self.pool.page_size
        ceiled = cdiv(n, ps) * ps
        self.reserved += ceiled + ps + (0 if truncated else min(req.max_new_tokens, self.clip_estimate))
        self.current_offset += ceiled + ps
        self.rem_input_tokens -= ceiled
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= ceiled
        self.can_run.append(req)
        self.prefix_lens.append(prefix)
        self.extend_lens.append(n)
        if truncated:
            self.new_chunked_req = req
        self.deferred.append((req, n))

    def add_chunked_req_sglang(self, req: Req) -> None:
        """SGLang's add_chunked_req: the carried request always runs, as much as min(chunk budget, KV budget)
        allows (the whole chunk budget when the KV budget is spent), not floored to a page."""
        chunk = self.rem_chunk_tokens
        assert chunk is not None, "a carried chunked request without chunking"
        rem = min(chunk, int(self._available_tokens() - self.reserved))
        rem = rem if rem > 0 else chunk
        extend = req.seq_len - req.kv_len
        self._charge(req, req.kv_len, min(extend, rem), extend > rem)

    def add_one_req_sglang(self, req: Req) -> AddResult:
        """SGLang 0.5.23's add_one_req: the whole remaining prompt plus min(remaining max_new_tokens, clip) plus a
        page must be < the KV budget (its prefix locked); without chunking (or with `input_check_with_chunking`)
        a request after the first must be < the input budget; a prompt over the chunk budget runs the budget
        floored to a page (refused if 0). Returns the budget state after admitting."""
        ps, tree = self.pool.page_size, self.tree
        key = req.fill_ids if req.output_ids else req.prompt_ids
        pages, node = tree.match_prefix(key, req.seq_len - 1)
        prefix = len(pages) * ps
        extend = req.seq_len - prefix
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip_estimate)
        tree.inc_lock_ref(node)  # the prefix is not evictable while the budget is checked (and after)
        ceiled = cdiv(extend, ps) * ps
        if not extend + max_new + ps < self._available_tokens() - self.reserved:
            tree.dec_lock_ref(node)
            return AddResult.NO_TOKEN
        if (self.rem_chunk_tokens is None or self.input_check_with_chunking) and self.can_run:
            if ceiled >= self.rem_input_tokens:
                tree.dec_lock_ref(node)
                return AddResult.OTHER
        n, truncated = extend, False
        if self.rem_chunk_tokens is not None and ceiled > self.rem_chunk_tokens:
            n, truncated = self.rem_chunk_tokens // ps * ps, True
            if n <= 0:
                tree.dec_lock_ref(node)
                return AddResult.OTHER
        req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = list(pages), len(pages), node, prefix
        req.cache_hit_tokens = min(prefix, req.prompt_len)
        req.host_hit_tokens = 0
        self.cache_hit_tokens += prefix
        self._charge(req, prefix, n, truncated)
        return self.budget_state()

    def add_waiting_sglang(self, ordered: list[Req]) -> list[Req]:
        """The waiting loop of SGLang's get_new_batch_prefill: stop when the input or chunk budget is spent,
        when the request slots are (`full`), or at the first request not admitted (`full` if out of KV
        while something is admitted or running)."""
        admitted = []
        self.blocked = self.blocked_result = None
        for req in ordered:
            if self.budget_state() is AddResult.OTHER:
                self.blocked, self.blocked_result = req, AddResult.OTHER
                break
            if len(self.can_run) >= self.max_new_reqs:
                self.full = True
                self.blocked, self.blocked_result = req, AddResult.OTHER
                break
            result = self.add_one_req_sglang(req)
            if self.can_run and self.can_run[-1] is req:
                admitted.append(req)
            elif result is not AddResult.CONTINUE:
                self.blocked, self.blocked_result = req, result
            if result is not AddResult.CONTINUE:
                if result is AddResult.NO_TOKEN:
                    self.full = bool(self.can_run) or bool(self.running)
                break
        return admitted

    def allocate_deferred(self) -> None:
        """The pages of the requests `_charge` admitted, all at once after selection (SGLang's alloc_for_extend:
        evict for the batch's extend tokens -- paged and conservative: plus a page per row -- then allocate)."""
        pool, ps = self.pool, self.pool.page_size
        need = sum(n for _, n in self.deferred)
        if ps > 1 and self.conservative_eviction:
            need += len(self.deferred) * ps
        short = need - pool.num_free * ps
        if short > 0:
            pool.free(self.tree.evict(cdiv(short, ps)))
        for req, n in self.deferred:
            if not self._alloc(req, n):
                raise RuntimeError(f"{req.rid}: prefill pages do not fit after admission")
        self.deferred.clear()

    def _admit(self, req: Req, prefix: int, n: int, truncated: bool) -> None:
        self.can_run.append(req)
        self.prefix_lens.append(prefix)
        self.extend_lens.append(n)
        self.rem_input_tokens -= n
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n
        if truncated:
            self.new_chunked_req = req
        else:
            self.reserved += self.reserved_for(req)
        if self.defer is not None:
            self.defer.add(req.fill_ids if req.output_ids else req.prompt_ids)

    def add_chunked_req(self, req: Req) -> bool:
        """The request carried from last round goes first; False if its pages do not fit."""
        extend = req.seq_len - req.kv_len
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return False
        n, truncated = self.chunk_len(extend)
        if n <= 0 or not self._alloc(req, n, self._spare()):
            return False
        self._admit(req, req.kv_len, n, truncated)
        return True

    def add_waiting(self, ordered: list[Req]) -> list[Req]:
        """Offer waiting requests in policy order until a budget stops it; returns the admitted ones."""
        admitted = []
        self.blocked = self.blocked_result = None
        for req in ordered:
            result = self.add_one_req(req)
            if self.can_run and self.can_run[-1] is req:
                admitted.append(req)
            elif result is AddResult.DEFERRED:
                self.prefix_deferred.append(req)
            else:
                self.blocked, self.blocked_result = req, result
            if result is not AddResult.CONTINUE and result is not AddResult.DEFERRED:
                break
        return admitted

    def release(self, req: Req) -> None:
        """A running request is being preempted (preemption.py): its reservation and slot come back."""
        if any(r is req for r in self.running):
            self.reserved -= min(req.remaining_new_tokens, self.clip_estimate) * self.new_token_ratio
            self.max_new_reqs += 1

    def add_one_req(self, req: Req, copy: bool = True) -> AddResult:
        """Admit `req` if the budgets allow. An n > 1 choice that cannot copy its prompt's last page (its
        page and the copy's would not both fit) is offered again without the copy (`copy=False`)."""
        if len(self.can_run) >= self.max_new_reqs:
            return AddResult.OTHER
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        ps, tree = self.pool.page_size, self.tree
        key = req.fill_ids if req.output_ids else req.prompt_ids
        limit = req.seq_len - 1 if req.logits_from is None else min(req.seq_len - 1, req.logits_from)
        pages, node = tree.match_prefix(key, limit)
        on_host = tree.match_host(key, node, limit)  # host-tier hits: loaded back below
        n_host = sum(len(h.key) for h in on_host) // ps
        prefix = (len(pages) + n_host) * ps
        source = None if on_host or not copy else self._fork_source(req, key, prefix)
        cow = None if source is None else source[0]
        if cow is not None:  # an n > 1 choice: it copies the prompt's last page and computes the last token only
            prefix = req.prompt_len - 1
            self._use_source(source)
        if self.defer is not None and self.defer.should_defer(key[: req.seq_len - 1], prefix):
            self._drop_source(source)
            return AddResult.DEFERRED
        n, truncated = self.chunk_len(req.seq_len - prefix)
        if n <= 0 or (
            self.can_run
            and n > self.rem_input_tokens
            and (self.rem_chunk_tokens is None or self.input_check_with_chunking)
        ):
            self._drop_source(source)
            return AddResult.OTHER
        tree.inc_lock_ref(node)
        need_pages = cdiv(prefix + n, ps) - len(pages)  # the host hits need device pages too
        need_tokens: float = need_pages * ps
        if not truncated:
            need_tokens += self.reserved_for(req)
        first = not self.can_run and not self.running
        fits = need_tokens <= self.rem_total_tokens
        if not fits and not (first and need_pages <= self.pool.num_free + tree.evictable_pages + self._kept()):
            tree.dec_lock_ref(node)
            return self._no_room(req, source)
        tree.pinned.update(id(h) for h in on_host)  # evictions below must not drop them
        try:
            # device pages for the host hits, or for the copied last page (never both: see _fork_source's caller)
            extra = self._alloc_pages(n_host + (cow is not None)) if n_host or cow is not None else []
            req.page_ids, req.n_cached_pages, req.last_node = list(pages) + (extra or []), len(pages), node
            req.kv_len = prefix
            if extra is None or not self._alloc(
                req, n, self._spare()
            ):  # the budget counted free + evictable + reclaimable pages
                if extra:
                    self.pool.free(extra)
                tree.dec_lock_ref(node)
                req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = [], 0, None, 0
                return self._no_room(req, source)
        finally:
            tree.pinned.difference_update(id(h) for h in on_host)
        if cow is not None:
            assert self.forks is not None, "a copied last page without fork pages"
            self.copies.append((cow, extra[0]))
            self.forks.copied += 1
        if self.forks is not None and req.after is not None and not req.forked:  # its one chance to copy: used
            last = self.forks.release(req)
            if last is not None:  # (another choice of this batch may copy from it: freed when the batch ran)
                self.free_after.append(last)
        if on_host:  # the host copies come back into their new pages before this batch's forward
            self.loads += tree.load(on_host, extra)
            tree.inc_lock_ref(on_host[-1])
            tree.dec_lock_ref(node)
            req.last_node, req.n_cached_pages = on_host[-1], len(pages) + n_host
            assert tree.host is not None, "host hits without a host tier"
            tree.host.stats.host_hit_tokens += n_host * ps
        req.cache_hit_tokens = min(prefix, req.prompt_len)  # prompt tokens (a retracted one also hits its output)
        req.host_hit_tokens = min(n_host * ps, req.cache_hit_tokens)
        self.cache_hit_tokens += prefix
        self._admit(req, prefix, n, truncated)
        return AddResult.OTHER if truncated else AddResult.CONTINUE
