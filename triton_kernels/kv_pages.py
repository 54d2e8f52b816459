"""Whole-page moves over the KV pool kv_cache [L, 2, num_pages, page_size, Hkv, D]:
copy_kv_pages (pool -> pool), gather_kv_pages (pool -> buffer), scatter_kv_pages (buffer -> pool).

One kernel copies page i of every (layer, K/V) plane: a plane's page is page_size * Hkv * D
contiguous elements. Triton cannot address host memory, so when the buffer is on another
device (pinned host memory for offload) gather copies into a device staging buffer and then
does one tensor copy to the host, and scatter does one tensor copy to the device first.

copy_kv_pages runs all copies in parallel: a page that is both a source and a destination
(chains like 1->2, 2->3) reads its old contents, unlike a sequential loop.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _copy_pages_kernel(
    src_ptr,
    dst_ptr,
    src_pages_ptr,
    dst_pages_ptr,
    stride_src_plane,
    stride_src_page,
    stride_dst_plane,
    stride_dst_page,
    PAGE_ELEMS: tl.constexpr,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0: K, 1: V)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_ELEMS
    if SRC_INDEXED:
        src_page = tl.load(src_pages_ptr + i).to(tl.int64)
    else:
        src_page = i.to(tl.int64)
    if DST_INDEXED:
        dst_page = tl.load(dst_pages_ptr + i).to(tl.int64)
    else:
        dst_page = i.to(tl.int64)
    x = tl.load(src_ptr + plane * stride_src_plane + src_page * stride_src_page + offs, mask=mask)
    tl.store(dst_ptr + plane * stride_dst_plane + dst_page * stride_dst_page + offs, x, mask=mask)


def _launch(src, dst, src_pages, dst_pages, n):
    """dst[:, :, dst_pages[i] or i] = src[:, :, src_pages[i] or i] for i < n (None: identity)."""
    assert src.is_contiguous() and dst.is_contiguous() and src.device == dst.device
    page_elems = src.shape[3] * src.shape[4] * src.shape[5]
    block = min(triton.next_power_of_2(page_elems), 4096)
    planes = src.shape[0] * src.shape[1]
    if n == 0 or planes == 0 or page_elems == 0:
        return
    grid = (n, planes, triton.cdiv(page_elems, block))
    wrap_triton(_copy_pages_kernel)[grid](
        src,
        dst,
        src_pages if src_pages is not None else src,  # dummy pointer when not indexed
        dst_pages if dst_pages is not None else dst,
        src.stride(1),
        src.stride(2),
        dst.stride(1),
        dst.stride(2),
        PAGE_ELEMS=page_elems,
        SRC_INDEXED=src_pages is not None,
        DST_INDEXED=dst_pages is not None,
        BLOCK=block,
    )


@triton_op("minisched_triton::copy_kv_pages", mutates_args={"kv_cache"})
def _copy_kv_pages_op(kv_cache: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    _launch(kv_cache, kv_cache, src_pages, dst_pages, src_pages.shape[0])


@triton_op("minisched_triton::gather_kv_pages", mutates_args={"out"})
def _gather_kv_pages_op(kv_cache: torch.Tensor, pages: torch.Tensor, out: torch.Tensor) -> None:
    if out.device == kv_cache.device:
        _launch(kv_cache, out, pages, None, pages.shape[0])
        return
    staging = torch.empty(out.shape, dtype=out.dtype, device=kv_cache.device)
    _launch(kv_cache, staging, pages, None, pages.shape[0])
    out.copy_(staging)


@triton_op("minisched_triton::scatter_kv_pages", mutates_args={"kv_cache"})
def _scatter_kv_pages_op(src: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor) -> None:
    if src.device != kv_cache.device:
        src = src.to(kv_cache.device)
    _launch(src, kv_cache, None, pages, pages.shape[0])


def copy_kv_pages(kv_cache, src_pages, dst_pages) -> None:
    torch.ops.minisched_triton.copy_kv_pages(kv_cache, src_pages, dst_pages)


def gather_kv_pages(kv_cache, pages, out) -> None:
    torch.ops.minisched_triton.gather_kv_pages(kv_cache, pages, out)


def scatter_kv_pages(src, kv_cache, pages) -> None:
    torch.ops.minisched_triton.scatter_kv_pages(src, kv_cache, pages)
