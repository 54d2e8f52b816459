"""paged_prefill_attention: ragged queries q [Nq, Hq, D] against their requests' paged KV.

Request b's queries are rows qo_indptr[b]:qo_indptr[b+1], the LAST qo_len_b positions of
its KV (the prefix comes through the page table); causal masking is bottom-right aligned:
query i sees KV positions <= kv_len - qo_len + i.

The GROUP query heads that share a kv head are packed into the M dimension (row r of a
request is token r // GROUP, head r % GROUP), so program (tile, kv head) reads each K/V
page once for BLOCK_M packed rows. Which request a tile belongs to is planned on the device
(cumsum + searchsorted over the per-request tile counts): no host sync, so the op traces
under torch.compile. The grid is an upper bound on the tile count; spare programs exit.
When the tiles cannot fill the GPU (few queries over a long KV, e.g. a shared prefix), the KV
range is split too and the fp32 partials are merged by paged_decode_attention's reduce kernel.
shared_prefix_attention runs the same kernel non-causally (see _launch).

No recompiles as batches change: the tile shape depends on head_dim only (prefill_tile), the
split count and request count are runtime ints that Triton does not specialize on. Tiles give
each warpgroup its own 64 query rows (BLOCK_M 64 / 4 warps, BLOCK_M 128 / 8 warps). A request
with no KV pages is an empty range (kv_len 0): its rows, if any, get o = 0, lse = -inf.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .paged_decode_attention import LOG2E, _dot, reduce_splits


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_ln", "stride_lh"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_ptr,
    tile_req_ptr,
    tile_first_ptr,
    o_ptr,
    lse_ptr,
    num_reqs,
    qk_scale,
    page_size,
    num_splits,
    stride_qn,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_on,
    stride_oh,
    stride_os,
    stride_ln,
    stride_lh,
    stride_ls,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_LSE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(tile_req_ptr + tile)
    if b >= num_reqs:
        return
    mt = tile - tl.load(tile_first_ptr + b)
    q_start = tl.load(qo_indptr_ptr + b)
    qo_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    page0 = tl.load(kv_indptr_ptr + b)
    npages = tl.load(kv_indptr_ptr + b + 1) - page0
    kv_len = tl.where(npages > 0, (npages - 1) * page_size + tl.load(kv_last_ptr + b), 0)  # no pages: empty

    # -- this tile's packed rows: (token, head in group) --
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < qo_len * GROUP
    tok = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = (q_start + tok).to(tl.int64) * stride_qn + heads * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)

    if CAUSAL:
        kv_limit = kv_len - qo_len + tok  # last KV position each row sees
        last_tok = tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // GROUP, qo_len - 1)
        kv_end = tl.minimum(kv_len, kv_len - qo_len + last_tok + 1)
    else:
        kv_end = kv_len
    # -- this split's KV range [kv_start, kv_stop) --
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_start = split * chunk
    kv_stop = tl.minimum(kv_start + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(kv_start, kv_stop, BLOCK_N):
        # -- gather BLOCK_N KV positions through the page table --
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < kv_stop
        page = tl.load(kv_indices_ptr + page0 + pos // page_size, mask=pmask, other=0).to(tl.int64)
        kv_off = page * stride_kp + (pos % page_size).to(tl.int64) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=pmask[:, None], other=0.0)
        # -- compute qk (log2 domain) and mask --
        qk = _dot(q, tl.trans(k), IEEE_DOT) * qk_scale
        if CAUSAL:
            keep = pmask[None, :] & (pos[None, :] <= kv_limit[:, None])
        else:
            keep = pmask[None, :]
        qk = tl.where(keep, qk, float("-inf"))
        # -- online softmax (a row may see nothing yet in a later split: keep it finite) --
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new

    # -- a row that saw no KV in this split writes o = 0, lse = -inf --
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_row = (q_start + tok).to(tl.int64) * stride_on + heads * stride_oh + split * stride_os
    tl.store(o_ptr + o_row[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
    if HAS_LSE:
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        lse_row = (q_start + tok).to(tl.int64) * stride_ln + heads * stride_lh + split * stride_ls
        tl.store(lse_ptr + lse_row, lse, mask=rmask)


def _launch(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, causal, sm_scale, out, lse):
    """Plan the (request, row tile) grid on the device and launch _prefill_kernel."""
    nq, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    batch = qo_indptr.shape[0] - 1
    if nq == 0 or batch <= 0 or hq == 0:
        return
    assert d in (16, 32, 64, 128, 256), f"head_dim {d}: the Triton kernels need a power of two in 16..256"
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert lse is None or lse.stride(1) == 1
    group = hq // hkv
    block_m, block_n, num_warps = prefill_tile(d)
    # -- device-side plan: tile t belongs to request tile_req[t] (== batch: spare program) --
    tiles = (qo_indptr[1:] - qo_indptr[:-1]) * group
    tiles = (tiles + (block_m - 1)) // block_m
    tile_last = torch.cumsum(tiles, 0, dtype=torch.int32)
    tile_first = tile_last - tiles
    max_tiles = triton.cdiv(nq * group, block_m) + batch
    tile_ids = torch.arange(max_tiles, dtype=torch.int32, device=q.device)
    tile_req = torch.searchsorted(tile_last, tile_ids, right=True, out_int32=True)
    splits = _num_splits(triton.cdiv(nq * group, block_m) * hkv, kv_indices.shape[0] * page_size, block_n)
    has_lse = lse is not None
    common = dict(
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=bool(causal),
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=PREFILL_STAGES,
    )
    args = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, tile_req, tile_first)
    scalars = (
        batch,
        sm_scale * LOG2E,
        page_size,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
    )
    grid = (max_tiles, hkv, splits)
    if splits == 1:
        lse_t = lse if has_lse else out  # dummy pointer when lse is not wanted
        wrap_triton(_prefill_kernel)[grid](
            *args,
            out,
            lse_t,
            *scalars,
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
    # -- split-KV: fp32 partials [Nq, Hq, splits, D] / [Nq, Hq, splits], then merged by LSE --
    part_o = torch.empty((nq, hq, splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((nq, hq, splits), dtype=torch.float32, device=q.device)
    wrap_triton(_prefill_kernel)[grid](
        *args,
        part_o,
        part_lse,
        *scalars,
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


PREFILL_STAGES = 3


def prefill_tile(head_dim: int) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps): one warpgroup per 64 query rows, so no two warpgroups repeat
    the same QK^T / softmax (BLOCK_M 64 with 8 warps did). Fixed per head_dim: never batch-dependent."""
    return (128, 64, 8) if head_dim > 64 else (64, 64, 4)


def _num_splits(programs: int, max_kv_len: int, block_n: int) -> int:
    """Split the KV range only when the (tile, kv head) programs cannot fill an H100/H200 (132 SMs)."""
    if programs >= 132:
        return 1
    return max(1, min(triton.cdiv(264, programs), triton.cdiv(max_kv_len, 4 * block_n), 16))


@triton_op("minisched_triton::paged_prefill_attention", mutates_args={"out", "lse"})
def _paged_prefill_attention_op(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    causal: bool,
    sm_scale: float,
    out: torch.Tensor,
    lse: Optional[torch.Tensor] = None,
) -> None:
    _launch(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, causal, sm_scale, out, lse)


def paged_prefill_attention(
    q,
    qo_indptr,
    k_cache,
    v_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    causal,
    sm_scale,
    out,
    lse=None,
    kernel: int = 0,
) -> None:
    """`kernel` picks a CUDA kernel of the native backend (the op schema's last argument); ignored here."""
    torch.ops.minisched_triton.paged_prefill_attention(
        q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, causal, sm_scale, out, lse
    )
