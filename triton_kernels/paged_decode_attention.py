"""paged_decode_attention: one query token per request, q [B, Hq, D], over its paged KV.

Split-KV (flash-decoding): program (b, kv head, split) walks its slice of request b's tokens
through the page table and keeps an online softmax for the GROUP query heads that share the
kv head, so each K/V page is read once per group. Every GQA ratio (1 included) runs the same
tl.dot path, the group padded to >= 16 rows: decode is bound by the K/V bytes, the padded MMA
rows are free, and only loads feeding a dot are software-pipelined by Triton (cp.async into
DECODE_STAGES-deep shared buffers; the page-index load is one stage ahead of the K/V gather).
With one split the kernel writes the output directly; otherwise it writes fp32 partials
(o, lse) and a second kernel merges them.

No recompiles in serving: the split count is a runtime argument (chosen from shapes only, no
host sync, so the op traces under torch.compile), and every int that changes with the batch
is marked do_not_specialize (Triton specializes ints equal to 1 or divisible by 16), so the
compiled variants depend on (dtype, GQA, head_dim, page_size) only, never on the batch.
An empty KV range (a request with no pages, or a split past the end) gives o = 0, lse = -inf.
Loaded values feed tl.dot in the input dtype with fp32 accumulation (fp32 inputs: "ieee").
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # the merge kernel holds up to this many partials per row (one compiled variant)
DECODE_STAGES = 5  # 5: the page index 2 tiles ahead, K/V double-buffered (TTGIR: 2x64xD local_alloc)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 operands in full precision (not tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    page_size,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_ls,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LSE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # -- this split's token range [start, end) of request b (no pages: kv_len 0) --
    page0 = tl.load(kv_indptr_ptr + b)
    npages = tl.load(kv_indptr_ptr + b + 1) - page0
    kv_len = tl.where(npages > 0, (npages - 1) * page_size + tl.load(kv_last_ptr + b), 0)
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None],
        other=0.0,
    )

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
        qk = _dot(q, tl.trans(k), IEEE_DOT)
        qk = tl.where(tmask[None, :], qk * qk_scale, float("-inf"))
        # -- online softmax (the first block of a non-empty split has a valid token) --
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new

    # -- an empty range (no pages, or a split past kv_len) writes o = 0, lse = -inf --
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_off = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
    if HAS_LSE:
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # natural log
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits", "stride_plb", "stride_plh"])
def _reduce_splits_kernel(  # also merges paged_prefill_attention's split-KV partials
    po_ptr,
    plse_ptr,
    o_ptr,
    lse_ptr,
    num_splits,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_lb,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    smask = offs_s < num_splits
    lse_s = tl.load(plse_ptr + b * stride_plb + h * stride_plh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, o = 0, lse = -inf
    w = tl.exp(lse_s - m)
    po = tl.load(
        po_ptr + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
        mask=smask[:, None],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    o = tl.sum(po * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty))
    if HAS_LSE:
        tl.store(lse_ptr + b * stride_lb + h, m + tl.log(total))


def _num_splits(batch: int, kv_heads: int, max_kv_len: int, block_n: int) -> int:
    """Enough (request, kv head, split) programs to fill ~2 waves of an H100/H200 (132 SMs)."""
    want = triton.cdiv(264, batch * kv_heads)
    return max(1, min(want, triton.cdiv(max_kv_len, 4 * block_n), MAX_SPLITS))


def reduce_splits(part_o, part_lse, out, lse) -> None:
    """out[n, h] (and lse) = the LSE merge of part_o [N, H, S, D] / part_lse [N, H, S] over its S splits."""
    n, h, splits, d = part_o.shape
    has_lse = lse is not None
    lse_t = lse if has_lse else out  # dummy pointer when lse is not wanted
    wrap_triton(_reduce_splits_kernel)[(n, h)](
        part_o,
        part_lse,
        out,
        lse_t,
        splits,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        lse_t.stride(0) if has_lse else 0,
        SPLITS_PAD=MAX_SPLITS,
        HEAD_DIM=d,
        HAS_LSE=has_lse,
        num_warps=4,
    )


@triton_op("minisched_triton::paged_decode_attention", mutates_args={"out", "lse"})
def _paged_decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: Optional[torch.Tensor] = None,
) -> None:
    batch, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    if batch == 0 or hq == 0:
        return
    assert d in (16, 32, 64, 128, 256), f"head_dim {d}: the Triton kernels need a power of two in 16..256"
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert lse is None or lse.stride(1) == 1
    group = hq // hkv
    block_n = 64
    splits = _num_splits(batch, hkv, kv_indices.shape[0] * page_size, block_n)
    has_lse = lse is not None
    common = dict(
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_N=block_n,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=4,
        num_stages=DECODE_STAGES,
    )
    grid = (batch, hkv, splits)
    qk_scale = sm_scale * LOG2E
    if splits == 1:
        lse_t = lse if has_lse else out  # dummy pointer when lse is not wanted
        wrap_triton(_decode_split_kernel)[grid](
            q,
            k_cache,
            v_cache,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            out,
            lse_t,
            qk_scale,
            page_size,
            1,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            out.stride(0),
            out.stride(1),
            0,
            lse_t.stride(0) if has_lse else 0,
            lse_t.stride(1) if has_lse else 0,
            0,
            HAS_LSE=has_lse,
            **common,
        )
        return
    part_o = torch.empty((batch, hq, splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, hq, splits), dtype=torch.float32, device=q.device)
    wrap_triton(_decode_split_kernel)[grid](
        q,
        k_cache,
        v_cache,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        part_o,
        part_lse,
        qk_scale,
        page_size,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        HAS_LSE=True,
        **common,
    )
    reduce_splits(part_o, part_lse, out, lse)


def paged_decode_attention(
    q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out, lse=None
) -> None:
    torch.ops.minisched_triton.paged_decode_attention(
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out, lse
    )
