"""PrefillAdder: admits waiting requests into one prefill batch under token budgets.

Budgets (tokens), as in SGLang's schedule_policy.PrefillAdder:

- input: `max_prefill_tokens` new tokens per batch; the first request may exceed it;
- chunk: `chunk_size` new tokens per batch; a request whose remaining prompt does not
  fit runs its first (page-aligned) part and is carried to the next round
  (`new_chunked_req`), where `add_chunked_req` puts it first;
- total: `(free + evictable pages) * page_size - reserved`, where `reserved` sums the
  future decode tokens (`min(remaining max_new_tokens, clip_estimate) * new_token_ratio`)
  of running and admitted requests; the clip (SGLang's CLIP_MAX_NEW_TOKENS) keeps one
  huge request from reserving the whole pool. When nothing runs and nothing is admitted
  yet, the first request is admitted as long as its pages fit at all, so a small pool
  never deadlocks.
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
from minisched.sched.kv_pool import KVPool
from minisched.sched.radix_cache import RadixCache
from minisched.sched.req import Req


class AddResult(enum.Enum):
    CONTINUE = "continue"  # admitted; try the next request
    DEFERRED = "deferred"  # skipped this round (in-batch prefix); try the next request
    NO_TOKEN = "no_token"  # out of KV budget; stop
    OTHER = "other"  # batch full (input/chunk/request budget); stop


@dataclass
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

    def __post_init__(self) -> None:
        clip = self.clip_estimate
        self.reserved += sum(min(r.remaining_new_tokens, clip) for r in self.running) * self.new_token_ratio
        self.rem_input_tokens -= self.mixed_decode_tokens
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= self.mixed_decode_tokens

    def _future(self, req: Req) -> float:
        return min(req.remaining_new_tokens, self.clip_estimate) * self.new_token_ratio

    @property
    def rem_total_tokens(self) -> float:
        return (self.pool.num_free + self.tree.evictable_pages) * self.pool.page_size - self.reserved

    def _alloc(self, req: Req, n_tokens: int) -> bool:
        need = self.pool.pages_needed(req, n_tokens)
        if need > self.pool.num_free:
            self.pool.free(self.tree.evict(need - self.pool.num_free))
        return self.pool.alloc_for_extend(req, n_tokens)

    def _chunk_len(self, extend: int) -> tuple[int, bool]:
        """New tokens to run this round and whether the request is truncated."""
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            return extend, False
        ps = self.pool.page_size
        n = self.rem_chunk_tokens - self.rem_chunk_tokens % ps
        return (n if n > 0 else self.rem_chunk_tokens), True

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
            self.reserved += self._future(req)
        if self.defer is not None:
            self.defer.add(req.fill_ids if req.output_ids else req.prompt_ids)

    def add_chunked_req(self, req: Req) -> bool:
        """The request carried from last round goes first; False if its pages do not fit."""
        extend = req.seq_len - req.kv_len
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return False
        n, truncated = self._chunk_len(extend)
        if n <= 0 or not self._alloc(req, n):
            return False
        self._admit(req, req.kv_len, n, truncated)
        return True

    def add_waiting(self, ordered: list[Req]) -> list[Req]:
        """Offer waiting requests in policy order until a budget stops it; returns the admitted ones."""
        admitted = []
        for req in ordered:
            result = self.add_one_req(req)
            if self.can_run and self.can_run[-1] is req:
                admitted.append(req)
            if result is not AddResult.CONTINUE and result is not AddResult.DEFERRED:
                break
        return admitted

    def add_one_req(self, req: Req) -> AddResult:
        if len(self.can_run) >= self.max_new_reqs:
            return AddResult.OTHER
        if self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0:
            return AddResult.OTHER
        key = req.fill_ids if req.output_ids else req.prompt_ids
        limit = req.seq_len - 1 if req.logits_from is None else min(req.seq_len - 1, req.logits_from)
        pages, node = self.tree.match_prefix(key, limit)
        prefix = len(pages) * self.pool.page_size
        if self.defer is not None and self.defer.should_defer(key[: req.seq_len - 1], prefix):
            return AddResult.DEFERRED
        n, truncated = self._chunk_len(req.seq_len - prefix)
        if self.can_run and n > self.rem_input_tokens:
            return AddResult.OTHER
        self.tree.inc_lock_ref(node)
        need_pages = cdiv(prefix + n, self.pool.page_size) - len(pages)
        need_tokens = need_pages * self.pool.page_size
        if not truncated:
            need_tokens += self._future(req)
        first = not self.can_run and not self.running
        fits = need_tokens <= self.rem_total_tokens
        if not fits and not (first and need_pages <= self.pool.num_free + self.tree.evictable_pages):
            self.tree.dec_lock_ref(node)
            return AddResult.NO_TOKEN
        req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = list(pages), len(pages), node, prefix
        if not self._alloc(req, n):  # cannot happen: the budget counted free + evictable pages
            self.tree.dec_lock_ref(node)
            req.page_ids, req.n_cached_pages, req.last_node, req.kv_len = [], 0, None, 0
            return AddResult.NO_TOKEN
        req.cache_hit_tokens = min(
            prefix, req.prompt_len
        )  # prompt tokens only (a retracted request also hits its own output)
        self.cache_hit_tokens += prefix
        self._admit(req, prefix, n, truncated)
        return AddResult.OTHER if truncated else AddResult.CONTINUE
