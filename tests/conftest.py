"""Shared fixtures: the (backend, device, dtype) targets every op test runs over, and paged-KV builders.

Without a GPU, Triton kernels run under the interpreter; TRITON_INTERPRET must be set before
triton_kernels is imported (decorated), so it is set here, before any test module loads.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minisched import ops  # noqa: E402
from minisched.base.page_table import build_csr  # noqa: E402


@dataclass(frozen=True)
class Target:
    backend: str
    device: str
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}-{str(self.dtype).removeprefix('torch.')}"

    @property
    def interpreted(self) -> bool:
        """Triton on the CPU runs in the (slow) interpreter: tests keep its shapes small."""
        return self.backend == "triton" and self.device == "cpu"

    @property
    def tol(self) -> dict:
        return {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
                torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float64: dict(atol=1e-10, rtol=1e-10)}[self.dtype]


def _triton_ready(family: str) -> str | None:
    try:
        importlib.import_module("triton")
        importlib.import_module(f"minisched.triton_kernels.{family}")
    except ImportError as exc:
        return f"triton kernels for {family} not importable: {exc}"
    return None


def targets(family: str, *, float64: bool = False) -> list:
    """pytest params over every backend × device × dtype; what cannot run here is skipped."""
    out = [Target("torch", "cpu", torch.float64 if float64 else torch.float32)]
    out += [Target("native", "cpu", torch.float32), Target("native", "cpu", torch.bfloat16)]
    out += [Target("triton", "cpu", torch.float32), Target("triton", "cpu", torch.float16)]
    out += [Target(b, "cuda", dt) for b in ("native", "triton") for dt in (torch.bfloat16, torch.float16)]
    params = []
    for t in out:
        skip = None
        if t.device == "cuda" and not HAS_CUDA:
            skip = "no CUDA device"
        elif t.device == "cpu" and t.backend == "triton" and HAS_CUDA:
            skip = "the Triton interpreter is only used on machines without a GPU"
        elif t.backend == "native" and not ops.native_available():
            skip = ops.NATIVE_ERROR
        elif t.backend == "triton":
            skip = _triton_ready(family)
        marks = [pytest.mark.skip(reason=skip)] if skip else []
        params.append(pytest.param(t, id=t.id, marks=marks))
    return params


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or a sentinel for integers) so unwritten rows are caught."""
    return t.fill_(float("nan") if t.is_floating_point() else -7)


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
        page_lists.append(perm[pos:pos + c])
        pos += c
    indptr, indices, last = build_csr(page_lists, kv_lens, page_size)
    shape = (num_pages, page_size, hkv, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    def t(a):
        return torch.from_numpy(a).to(device)

    return PagedKV(k, v, t(indptr), t(indices), t(last), list(kv_lens))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def to_ref(*tensors):
    """The oracle's inputs: float64 copies on the CPU."""
    return [t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu() for t in tensors]


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

