"""In-batch prefix deferral (SGLang's IN_BATCH_PREFIX_CACHING_CHECK/DEFER_THRESHOLD).

When several waiting requests share a prefix that is not cached yet, admitting them all in
one batch computes that prefix once per request: the radix cache only learns it after the
batch. So the first one is admitted and the others wait one round, then hit the cache:
64 requests sharing 512 tokens compute 512 + 64 * suffix tokens instead of 512 * 64.

`InBatchPrefixes` is a throw-away radix tree (page-aligned, no real pages) of the keys
admitted to the batch being built. A request is deferred when a key in it covers at least
`threshold` more tokens than the request's cached prefix; measuring the uncached overlap also
catches a long shared continuation of a short cached one. SGLang 0.5.23 does not skip: for the
cache-aware policies only, a request with at most `threshold` cached tokens that shares at least
`threshold` with an earlier such waiting request is sorted to the end of an LPM queue
(`in_batch_prefix_rule="sglang"`, policy.py). Pure Python.
"""

from __future__ import annotations

from minisched.sched.radix_cache import RadixCache


class InBatchPrefixes:
    def __init__(self, page_size: int, threshold: int) -> None:
        self.tree = RadixCache(page_size)
        self.threshold = threshold
        self.num_deferred = 0

    def add(self, key: list[int]) -> None:
        self.tree.insert(key, [0] * (len(key) // self.tree.page_size))

    def should_defer(self, key: list[int], cached_len: int) -> bool:
        """`key`: the request's match key; `cached_len`: its prefix found in the real cache."""
        if len(key) - cached_len < self.threshold:
            return False
        pages, _ = self.tree.match_prefix(key)
        if len(pages) * self.tree.page_size - cached_len < self.threshold:
            return False
        self.num_deferred += 1
        return True
