"""store_kv: write N new tokens' K/V [N, Hkv, D] into one layer's paged caches at their slots.

k_cache/v_cache are [num_pages, page_size, Hkv, D] and contiguous, so slot s starts at
s * Hkv * D. A negative slot means "skip" (padding tokens).
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_heads,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_cslot, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    src = t.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + src * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = slot * stride_cslot + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton_op("minisched_triton::store_kv", mutates_args={"k_cache", "v_cache"})
def _store_kv_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    n, hkv, d = k.shape
    if n * hkv * d == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert slot_mapping.dtype == torch.int32 and slot_mapping.is_contiguous()
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hkv), 4096 // block_d))
    grid = (n, triton.cdiv(hkv, block_h))
    wrap_triton(_store_kv_kernel)[grid](
        k, v, k_cache, v_cache, slot_mapping,
        hkv,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
    )


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    torch.ops.minisched_triton.store_kv(k, v, k_cache, v_cache, slot_mapping)
