"""merge_attention_states: combine two partial attentions over disjoint KV sets by log-sum-exp.

v_* [N, H, D], lse_* [N, H] float32 (natural log). A side with lse = -inf carries no weight;
when both are -inf the output is 0 with lse -inf (as the reference).
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _merge_kernel(
    va_ptr,
    la_ptr,
    vb_ptr,
    lb_ptr,
    vo_ptr,
    lo_ptr,
    num_heads,
    stride_vn,
    stride_vh,
    stride_ln,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < num_heads
    mask = hmask[:, None] & (offs_d[None, :] < HEAD_DIM)
    la = tl.load(la_ptr + n * stride_ln + offs_h, mask=hmask, other=0.0).to(tl.float32)
    lb = tl.load(lb_ptr + n * stride_ln + offs_h, mask=hmask, other=0.0).to(tl.float32)
    # -- weights relative to the larger lse (0 when it is infinite, as the reference) --
    m = tl.maximum(la, lb)
    m = tl.where((m == float("inf")) | (m == float("-inf")), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    denom = tl.where(total > 0, total, 1.0)
    v_off = n * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :]
    va = tl.load(va_ptr + v_off, mask=mask, other=0.0).to(tl.float32)
    vb = tl.load(vb_ptr + v_off, mask=mask, other=0.0).to(tl.float32)
    vo = (va * wa[:, None] + vb * wb[:, None]) / denom[:, None]
    tl.store(vo_ptr + v_off, vo.to(vo_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptr + n * stride_ln + offs_h, m + tl.log(total), mask=hmask)


@triton_op("minisched_triton::merge_attention_states", mutates_args={"v_out", "lse_out"})
def _merge_attention_states_op(
    v_a: torch.Tensor,
    lse_a: torch.Tensor,
    v_b: torch.Tensor,
    lse_b: torch.Tensor,
    v_out: torch.Tensor,
    lse_out: torch.Tensor,
) -> None:
    n, h, d = v_a.shape
    if n == 0 or h == 0:
        return
    for t in (v_a, v_b, v_out):
        assert t.stride() == v_a.stride() and t.stride(2) == 1
    for t in (lse_a, lse_b, lse_out):
        assert t.stride() == lse_a.stride() and t.stride(1) == 1
    block_d = max(1, triton.next_power_of_2(d))
    block_h = max(1, min(triton.next_power_of_2(h), 2048 // block_d))
    grid = (n, triton.cdiv(h, block_h))
    wrap_triton(_merge_kernel)[grid](
        v_a,
        lse_a,
        v_b,
        lse_b,
        v_out,
        lse_out,
        h,
        v_a.stride(0),
        v_a.stride(1),
        lse_a.stride(0),
        HEAD_DIM=d,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out) -> None:
    torch.ops.minisched_triton.merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out)
