"""Page-table arithmetic for the FlashInfer-style CSR page table (docs/architecture.md, "The paged KV cache").

A request of kv_len tokens holds ceil(kv_len / page_size) pages; its last page
holds last_page_len in 1..page_size tokens; token t lives at slot
page_ids[t // page_size] * page_size + t % page_size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from minisched.base.values import cdiv


def last_page_len(kv_len: int, page_size: int) -> int:
    """Tokens in the last page of a request of kv_len >= 1 tokens (1..page_size)."""
    if kv_len < 1:
        raise ValueError(f"kv_len must be >= 1, got {kv_len}")
    return (kv_len - 1) % page_size + 1


def kv_len_of(num_pages: int, last_len: int, page_size: int) -> int:
    """Inverse of (cdiv(kv_len, page_size), last_page_len)."""
    return (num_pages - 1) * page_size + last_len


def slots_of(page_ids: Sequence[int], start: int, end: int, page_size: int) -> np.ndarray:
    """Slots of token positions start..end-1 of a request whose pages are page_ids."""
    pos = np.arange(start, end, dtype=np.int64)
    pages = np.asarray(page_ids, dtype=np.int64)[pos // page_size]
    return (pages * page_size + pos % page_size).astype(np.int32)


def build_csr(
    page_lists: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kv_indptr int32[B+1], kv_indices int32[nnz], kv_last_page_len int32[B]) for requests with these
    pages and lengths, 1 <= last_page_len <= page_size. Only the pages a request's kv_len needs are used;
    extra trailing pages are ignored."""
    counts = [cdiv(n, page_size) for n in kv_lens]
    for pages, n, c in zip(page_lists, kv_lens, counts):
        if len(pages) < c:
            raise ValueError(f"{n} tokens need {c} pages of {page_size}, request has {len(pages)}")
    indptr = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.fromiter(
        (p for pages, c in zip(page_lists, counts) for p in pages[:c]), dtype=np.int32, count=int(indptr[-1])
    )
    last = np.array([last_page_len(n, page_size) for n in kv_lens], dtype=np.int32)
    return indptr, indices, last


def kv_lens_from_csr(kv_indptr: ArrayLike, kv_last_page_len: ArrayLike, page_size: int) -> np.ndarray:
    """Each request's KV length from its CSR page table."""
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    return (np.diff(indptr) - 1) * page_size + last
