"""Random paged K/V caches with their page tables, and the attention tests' shared shapes and lengths."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from minisched.base.page_table import build_csr


@dataclass
class PagedKV:
    """One layer's random paged K/V for a batch, with its page table (pages shuffled over the pool)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: list

    @property
    def table(self) -> tuple:
        return self.kv_indptr, self.kv_indices, self.kv_last_page_len


def make_paged_kv(kv_lens, page_size, hkv, head_dim, dtype, device, *, gen, spare_pages: int = 3) -> PagedKV:
    """Random caches (values ~N(0,1), never zero) with each request's pages drawn at random from the pool."""
    need = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_lists, pos = [], 0
    for c in need:
        page_lists.append(perm[pos : pos + c])
        pos += c
    indptr, indices, last = build_csr(page_lists, kv_lens, page_size)
    shape = (num_pages, page_size, hkv, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    def t(a):
        return torch.from_numpy(a).to(device)

    return PagedKV(k, v, t(indptr), t(indices), t(last), list(kv_lens))


def without_pages(kv, empty) -> PagedKV:
    """The same caches with requests `empty` given no pages: an empty KV range (kv_len 0; last_page_len kept)."""
    ip, idx = kv.kv_indptr.cpu().tolist(), kv.kv_indices.cpu()
    lists = [[] if b in empty else idx[ip[b] : ip[b + 1]].tolist() for b in range(len(ip) - 1)]
    indptr = torch.tensor([0] + [sum(map(len, lists[: b + 1])) for b in range(len(lists))], dtype=torch.int32)
    indices = torch.tensor([p for pages in lists for p in pages], dtype=torch.int32)
    dev = kv.kv_indptr.device
    return PagedKV(
        kv.k_cache,
        kv.v_cache,
        indptr.to(dev),
        indices.to(dev),
        kv.kv_last_page_len,
        [0 if b in empty else n for b, n in enumerate(kv.kv_lens)],
    )


# Shapes shared by the attention tests: (page_size, head_dim, q heads, kv heads) covering
# page sizes 1 and 16, head_dim 64 and 128 and GQA ratios 1, 3 and 8.
ATTN_SHAPES = [
    pytest.param(1, 64, 4, 4, id="ps1-d64-gqa1"),
    pytest.param(16, 64, 9, 3, id="ps16-d64-gqa3"),
    pytest.param(16, 128, 8, 1, id="ps16-d128-gqa8"),
    pytest.param(1, 128, 6, 2, id="ps1-d128-gqa3"),
    pytest.param(16, 128, 4, 4, id="ps16-d128-gqa1"),
    pytest.param(1, 64, 16, 2, id="ps1-d64-gqa8"),
]


def ragged_lens(page_size: int, long: int = 300) -> list:
    """Lengths 1, exactly a page, a page plus one, and a few hundred."""
    return [1, page_size, page_size + 1, long]
