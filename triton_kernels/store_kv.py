"""store_kv: write N new tokens' K/V [N, Hkv, D] into one layer's paged caches at their slots.

k_cache/v_cache are [num_pages, page_size, Hkv, D] and contiguous, so slot s starts at
s * Hkv * D. A negative slot means "skip" (padding tokens).
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit(do_not_specialize=["num_tokens"])  # N is the batch in decode: no recompiles
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    num_heads,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_cslot,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # -- a [BLOCK_T tokens, BLOCK_H heads, BLOCK_D] tile; tokens with slot < 0 are masked off --
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    t3 = offs_t.to(tl.int64)[:, None, None]
    h3 = offs_h[None, :, None]
    d3 = offs_d[None, None, :]
    mask = (slot >= 0)[:, None, None] & (h3 < num_heads) & (d3 < HEAD_DIM)
    k = tl.load(k_ptr + t3 * stride_kn + h3 * stride_kh + d3 * stride_kd, mask=mask)
    v = tl.load(v_ptr + t3 * stride_vn + h3 * stride_vh + d3 * stride_vd, mask=mask)
    dst = slot[:, None, None] * stride_cslot + h3 * stride_ch + d3
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton_op("minisched_triton::store_kv", mutates_args={"k_cache", "v_cache"})
def _store_kv_op(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    n, hkv, d = k.shape
    if n * hkv * d == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert slot_mapping.dtype == torch.int32 and slot_mapping.is_contiguous()
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hkv), 2048 // block_d))  # <= 2048 elements: no spills
    block_t = max(1, 2048 // (block_h * block_d))  # never from n: one compiled variant for every batch
    grid = (triton.cdiv(n, block_t), triton.cdiv(hkv, block_h))
    wrap_triton(_store_kv_kernel)[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        n,
        hkv,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=d,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    torch.ops.minisched_triton.store_kv(k, v, k_cache, v_cache, slot_mapping)
