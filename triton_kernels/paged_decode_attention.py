"""paged_decode_attention: one query token per request, q [B, Hq, D], over its paged KV.

Split-KV (flash-decoding): program (b, kv head, split) walks its slice of request b's tokens
through the page table and keeps an online softmax for the GROUP query heads that share the
kv head, so each K/V page is read once per group. Group >= 4 uses tl.dot (the group padded
to 16 rows), smaller groups an elementwise product. With one split the kernel writes the
output directly; otherwise it writes fp32 partials (o, lse) and a second kernel merges them.
The number of splits comes from shapes only (no host sync, so the op traces under torch.compile).
Loaded values are upcast to fp32; tl.dot takes its operands in the input dtype, accumulates in
fp32 (fp32 inputs: input_precision "ieee").
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 operands in full precision (not tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_ptr,
    o_ptr, lse_ptr,
    qk_scale, page_size,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, HAS_LSE: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # -- this split's token range [start, end) of request b --
    page0 = tl.load(kv_indptr_ptr + b)
    npages = tl.load(kv_indptr_ptr + b + 1) - page0
    kv_len = (npages - 1) * page_size + tl.load(kv_last_ptr + b)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        # -- gather BLOCK_N tokens through the page table --
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        page = tl.load(kv_indices_ptr + page0 + tok // page_size, mask=tmask, other=0).to(tl.int64)
        kv_off = page * stride_kp + (tok % page_size).to(tl.int64) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
        # -- compute qk (log2 domain) --
        if USE_DOT:
            qk = _dot(q, tl.trans(k), IEEE_DOT)
        else:
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        qk = tl.where(tmask[None, :], qk * qk_scale, float("-inf"))
        # -- online softmax (the first block of a non-empty split has a valid token) --
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = _dot(p.to(v.dtype), v, IEEE_DOT)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # -- an empty split (start >= kv_len) writes o = 0, lse = -inf --
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
    if HAS_LSE:
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # natural log
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=gmask)


@triton.jit
def _reduce_splits_kernel(  # also merges paged_prefill_attention's split-KV partials
    po_ptr, plse_ptr, o_ptr, lse_ptr,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_ob, stride_oh, stride_lb,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_LSE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    smask = offs_s < NUM_SPLITS
    lse_s = tl.load(plse_ptr + b * stride_plb + h * stride_plh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, axis=0)  # finite: split 0 holds KV position 0, which every query sees
    w = tl.exp(lse_s - m)
    po = tl.load(po_ptr + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
                 mask=smask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(po * w[:, None], axis=0) / total
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty))
    if HAS_LSE:
        tl.store(lse_ptr + b * stride_lb + h, m + tl.log(total))


def _num_splits(batch: int, kv_heads: int, max_kv_len: int, block_n: int) -> int:
    """Enough (request, kv head, split) programs to fill ~2 waves of an H100/H200 (132 SMs)."""
    want = triton.cdiv(264, batch * kv_heads)
    return max(1, min(want, triton.cdiv(max_kv_len, 4 * block_n), 32))


@triton_op("minisched_triton::paged_decode_attention", mutates_args={"out", "lse"})
def _paged_decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                               sm_scale: float, out: torch.Tensor, lse: Optional[torch.Tensor] = None) -> None:
    batch, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    if batch == 0 or hq == 0:
        return
    assert d in (16, 32, 64, 128, 256), f"head_dim {d}: the Triton kernels need a power of two in 16..256"
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert lse is None or lse.stride(1) == 1
    group = hq // hkv
    use_dot = group >= 4
    if use_dot:
        group_pad, block_n = max(16, triton.next_power_of_2(group)), 64
    else:
        group_pad = triton.next_power_of_2(group)
        block_n = max(16, min(64, 8192 // (group_pad * d)))  # the [GROUP_PAD, BLOCK_N, D] product stays small
    splits = _num_splits(batch, hkv, kv_indices.shape[0] * page_size, block_n)
    has_lse = lse is not None
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_N=block_n, NUM_SPLITS=splits,
                  USE_DOT=use_dot, IEEE_DOT=q.dtype == torch.float32,
                  num_warps=4)
    grid = (batch, hkv, splits)
    qk_scale = sm_scale * LOG2E
    if splits == 1:
        lse_t = lse if has_lse else out  # dummy pointer when lse is not wanted
        wrap_triton(_decode_split_kernel)[grid](
            q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out, lse_t,
            qk_scale, page_size,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1), 0,
            lse_t.stride(0) if has_lse else 0, lse_t.stride(1) if has_lse else 0, 0,
            HAS_LSE=has_lse, **common,
        )
        return
    part_o = torch.empty((batch, hq, splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, hq, splits), dtype=torch.float32, device=q.device)
    wrap_triton(_decode_split_kernel)[grid](
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, part_o, part_lse,
        qk_scale, page_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        HAS_LSE=True, **common,
    )
    lse_t = lse if has_lse else out
    wrap_triton(_reduce_splits_kernel)[(batch, hq)](
        part_o, part_lse, out, lse_t,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse_t.stride(0) if has_lse else 0,
        NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=d, HAS_LSE=has_lse,
        num_warps=4,
    )


def paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out,
                           lse=None) -> None:
    torch.ops.minisched_triton.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices,
                                                      kv_last_page_len, sm_scale, out, lse)
