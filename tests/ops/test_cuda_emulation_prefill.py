"""Numpy emulation of the CUDA prefill CTA (runs without a GPU): 32 query rows per warp.

paged_attention_kernel<T, D, 4, 1, 2> (csrc/cuda/attention_kernel.cu) is the prefill / shared-prefix CTA:
4 warps, each owning RF = 2 m16 row fragments (32 packed rows p = token * group + h: a 128-row tile), every
K (ldmatrix.x4) and V (ldmatrix.x4.trans) fragment feeding both fragments' mma.sync; Q is reloaded from
shared memory per k-step (not kept in registers); thread row i (0..3) is warp row f * 16 + h * 8 + lane / 4
with f = i / 2, h = i % 2; the causal limit of row 0 is kept (need_mask) and the others are recomputed in
boundary tiles. This file replays that per lane with the fragment helpers of tests/helpers/cuda_emulation.py,
K/V tiles filled by the loader emulation there, the tile map / locate_tile (also there) with the
128-row tile height and the host's grid bound, the bad-page-table / empty-range rules and the split merge,
in float64 against minisched.ops.reference (paged_prefill_attention, shared_prefix_attention).
`bug` injects a deliberate error in the new index math; test_index_bugs_are_caught checks each one fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.cuda_emulation import (
    BLOCK_N,
    LANES,
    C,
    G,
    emulate_loader,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    locate_tile,
    mma_16816,
    prefill_case,
    quad_reduce,
    tile_map,
)
from helpers.paged_kv import make_paged_kv
from minisched.ops import reference

ROW_WARPS, RF = 4, 2  # the prefill CTA: 4 warps x 2 row fragments
WARPS = 4


def wrow(rw, i, rf=RF, bug=None):
    """Warp rw's thread row i (per lane): rw * WR + lane / 4 + (i / 2) * 16 + (i % 2) * 8."""
    if bug == "swap-row-halves":
        return rw * 16 * rf + G + (i >> 1) * 8 + (i & 1) * 16
    return rw * 16 * rf + G + (i >> 1) * 16 + (i & 1) * 8


def emulate_cta(d, q_rows, fill_tile, s_beg, s_end, scale, limit_of, causal, rf=RF, bug=None):
    """One CTA (4 x 1 warps, rf row fragments each): q_rows [rows_tile, d] (zero past the valid rows), tiles
    filled by fill_tile(t, k_stage, v_stage), limit_of(r) the kernel's limit of CTA row r (per lane array).
    Returns out [rows_tile, d] (o / l) and lse [rows_tile] (natural log) as the epilogue computes them."""
    sp, nt, ks_n, dt, wr = d + 8, BLOCK_N // 8, d // 16, d // 8, 16 * rf
    rows_tile = wr * ROW_WARPS
    sq = np.zeros(rows_tile * sp)
    for r in range(rows_tile):
        sq[r * sp : r * sp + d] = q_rows[r]
    sk, sv = np.zeros(2 * BLOCK_N * sp), np.zeros(2 * BLOCK_N * sp)
    n_tiles = 0 if s_end <= s_beg else -(-(s_end - s_beg) // BLOCK_N)
    scale_log2 = scale * np.log2(np.e)

    def ld_q(rw, f, ks):  # the A fragment of row fragment f: rows rw * WR + f * 16 + lane % 16
        f_off = f * 8 if bug == "q-fragment-offset" else f * 16
        return ldmatrix_x4(sq, (rw * wr + f_off + (LANES & 15)) * sp + ks * 16 + (LANES >> 4) * 8)

    state = {
        rw: dict(o=np.zeros((rf, dt, 32, 4)), m=np.full((2 * rf, 32), -np.inf), l=np.zeros((2 * rf, 32)))
        for rw in range(ROW_WARPS)
    }
    for t in range(n_tiles):
        st = t & 1
        fill_tile(
            t,
            sk[st * BLOCK_N * sp : (st + 1) * BLOCK_N * sp].reshape(BLOCK_N, sp),
            sv[st * BLOCK_N * sp : (st + 1) * BLOCK_N * sp].reshape(BLOCK_N, sp),
        )
        for rw in range(ROW_WARPS):
            w = state[rw]
            if rf == 1 and t == 0:  # one fragment: Q in registers, loaded once
                w["qa"] = [ld_q(rw, 0, ks) for ks in range(ks_n)]
            kv_base = st * BLOCK_N * sp
            tok0 = s_beg + t * BLOCK_N
            s = np.zeros((rf, nt, 32, 4))
            for ks in range(ks_n):
                qs = [w["qa"][ks]] if rf == 1 else [ld_q(rw, f, ks) for f in range(rf)]
                for nb in range(nt // 2):
                    kb = ldmatrix_x4(
                        sk, kv_base + (nb * 16 + (LANES & 7) + (LANES >> 4) * 8) * sp + ks * 16 + ((LANES >> 3) & 1) * 8
                    )
                    for f in range(rf):  # one K fragment, rf mma pairs
                        mma_16816(s[f, 2 * nb], qs[f], kb[:, 0], kb[:, 1])
                        mma_16816(s[f, 2 * nb + 1], qs[f], kb[:, 2], kb[:, 3])
            s *= scale_log2
            limit0 = limit_of(wrow(rw, 3 if bug == "need-mask-last-row" else 0, rf, bug))
            need_mask = (tok0 + BLOCK_N > s_end) | (causal & (tok0 + BLOCK_N - 1 > limit0))  # per lane
            for i in range(2 * rf):
                lim = np.minimum(s_end - 1, limit_of(wrow(rw, i, rf, bug)))
                f, h = i >> 1, (i & 1) * 2
                for j in range(nt):
                    for e in range(2):
                        tok = tok0 + j * 8 + C * 2 + e
                        s[f, j, :, h + e] = np.where(need_mask & (tok > lim), -np.inf, s[f, j, :, h + e])
            for i in range(2 * rf):  # online softmax, row i = s[i / 2][.][2 (i % 2) + {0, 1}]
                f, h = i >> 1, (i & 1) * 2
                mx = quad_reduce(np.max(s[f, :, :, h : h + 2], axis=(0, 2)), np.maximum)
                m_new = np.maximum(w["m"][i], mx)
                m_use = np.where(m_new == -np.inf, 0.0, m_new)
                alpha = np.exp2(w["m"][i] - m_use)
                w["m"][i] = m_new
                s[f, :, :, h : h + 2] = np.exp2(s[f, :, :, h : h + 2] - m_use[None, :, None])
                w["l"][i] = w["l"][i] * alpha + s[f, :, :, h : h + 2].sum(axis=(0, 2))
                w["o"][f, :, :, h : h + 2] *= alpha[None, :, None]
            for kb_i in range(nt // 2):
                pa = [
                    np.stack(
                        [
                            s[f, 2 * kb_i][:, 0:2],
                            s[f, 2 * kb_i][:, 2:4],
                            s[f, 2 * kb_i + 1][:, 0:2],
                            s[f, 2 * kb_i + 1][:, 2:4],
                        ],
                        axis=1,
                    )
                    for f in range(rf)
                ]
                for dp in range(dt // 2):
                    vb = ldmatrix_x4_trans(
                        sv,
                        kv_base + (kb_i * 16 + (LANES & 7) + ((LANES >> 3) & 1) * 8) * sp + dp * 16 + (LANES >> 4) * 8,
                    )
                    for f in range(rf):  # one V fragment, rf mma pairs
                        mma_16816(w["o"][f, 2 * dp], pa[f], vb[:, 0], vb[:, 1])
                        mma_16816(w["o"][f, 2 * dp + 1], pa[f], vb[:, 2], vb[:, 3])
    out, lse = np.full((rows_tile, d), np.nan), np.full(rows_tile, np.nan)
    written = np.zeros(rows_tile, dtype=np.int64)
    for rw in range(ROW_WARPS):  # the epilogue
        w = state[rw]
        for i in range(2 * rf):
            f, h = i >> 1, (i & 1) * 2
            l_ = quad_reduce(w["l"][i], np.add)
            inv = np.where(l_ > 0, 1.0 / np.where(l_ > 0, l_, 1.0), 0.0)
            lse_v = np.where(l_ > 0, (w["m"][i] + np.log2(np.where(l_ > 0, l_, 1.0))) * np.log(2.0), -np.inf)
            r = wrow(rw, i, rf, bug)
            for j in range(dt):
                out[r, j * 8 + C * 2] = w["o"][f, j, :, h] * inv
                out[r, j * 8 + C * 2 + 1] = w["o"][f, j, :, h + 1] * inv
            lse[r] = lse_v
            np.add.at(written, r[C == 0], 1)  # one (row, lse) per quad
    assert (written == 1).all(), "every CTA row is owned by exactly one (warp, lane quad, thread row)"
    return out, lse


def emulate_prefill(
    q, qo_indptr, k_cache, v_cache, indptr, indices, last, causal, scale, num_splits=1, rf=RF, bug=None
):
    """The ragged launch: tile map, grid (host bound) x kv heads x splits of CTAs, then merge_splits_kernel over
    the same grid. Returns out, lse (NaN where never written) and the per-row write counts of the last pass."""
    num_qo, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    g, rows_tile, batch, nnz = hq // hkv, 16 * rf * ROW_WARPS, len(qo_indptr) - 1, len(indices)
    offsets = tile_map(qo_indptr, num_qo, g, rows_tile)
    grid_x = -(-num_qo * g // rows_tile) + batch  # grid_columns: ceil(num_qo * group / rows_tile) + batch
    assert offsets[batch] <= grid_x, "the host's grid bound covers the tile map"
    kflat, vflat = k_cache.reshape(-1), v_cache.reshape(-1)
    part_o = np.full((num_splits, num_qo, hq, d), np.nan)
    part_l = np.full((num_splits, num_qo, hq), np.nan)
    counts = np.zeros((num_splits, num_qo, hq), dtype=np.int64)
    for kvh in range(hkv):
        for x in range(grid_x):
            ok, b, tile, q_start, qo_len = locate_tile(x, qo_indptr, offsets, 0)
            if not ok:
                continue
            row_beg = tile * (64 if bug == "cta-row-beg-64" else rows_tile)
            rows_valid = min(rows_tile, qo_len * g - row_beg)
            kv_beg, kv_endp, lst = int(indptr[b]), int(indptr[b + 1]), int(last[b])
            bad = not (0 <= kv_beg <= kv_endp <= nnz and 1 <= lst <= page_size)
            kv_len = (kv_endp - kv_beg - 1) * page_size + lst if kv_endp > kv_beg else 0
            bad = bad or kv_len > 0x7FFFFFFF or (causal and kv_len < qo_len)
            kv_len = 0 if bad else kv_len

            def limit_of(r, kv_len=kv_len, qo_len=qo_len, row_beg=row_beg):
                return kv_len - qo_len + (row_beg + r) // g if causal else np.full_like(r, kv_len - 1)

            q_rows = np.zeros((rows_tile, d))
            for r in range(rows_tile):
                pr = row_beg + r
                if not bad and r < rows_valid:
                    q_rows[r] = q[q_start + pr // g, kvh * g + pr % g]
            for split in range(num_splits):
                chunk = -(-kv_len // num_splits)
                chunk = -(-chunk // BLOCK_N) * BLOCK_N
                s_beg = split * chunk
                s_end = min(kv_len, s_beg + chunk)
                if causal and rows_valid > 0:
                    s_end = min(s_end, kv_len - qo_len + (row_beg + rows_valid - 1) // g + 1)
                flags = []

                def fill(t, tk, tv, s_beg=s_beg, s_end=s_end, kv_beg=kv_beg, flags=flags):
                    copies, bad_page = emulate_loader(
                        WARPS, d, page_size, hkv, kvh, indices, kv_beg, num_pages, s_beg + t * BLOCK_N, s_end
                    )
                    flags.append(bad_page)
                    for (r, c), src in copies.items():
                        tk[r, c * 8 : c * 8 + 8] = 0.0 if src is None else kflat[src : src + 8]
                        tv[r, c * 8 : c * 8 + 8] = 0.0 if src is None else vflat[src : src + 8]

                o, lse = emulate_cta(
                    d, q_rows, fill, s_beg, s_end if not bad else s_beg, scale, limit_of, causal, rf, bug
                )
                cta_bad = bad or any(flags)
                for r in range(rows_valid):  # the epilogue writes rows r < rows_valid
                    pr = row_beg + r
                    tok, head = q_start + pr // g, kvh * g + pr % g
                    part_o[split, tok, head] = np.nan if cta_bad else o[r]
                    part_l[split, tok, head] = np.nan if cta_bad else lse[r]
                    counts[split, tok, head] += 1
    if num_splits == 1:
        return part_o[0], part_l[0], counts[0]
    out, out_l = np.full((num_qo, hq, d), np.nan), np.full((num_qo, hq), np.nan)
    mcounts = np.zeros((num_qo, hq), dtype=np.int64)
    for kvh in range(hkv):  # merge_splits_kernel over the same (tile, kv head) grid
        for x in range(grid_x):
            ok, b, tile, q_start, qo_len = locate_tile(x, qo_indptr, offsets, 0)
            if not ok:
                continue
            m_rows = 64 if bug == "merge-tile-height-64" else rows_tile  # merge_splits_kernel's rows_tile argument
            row_beg = tile * m_rows
            for pr in range(row_beg, row_beg + min(m_rows, qo_len * g - row_beg)):
                tok, head = q_start + pr // g, kvh * g + pr % g
                pl = part_l[:, tok, head]
                assert (counts[:, tok, head] == 1).all(), "merge reads a partial no split wrote"
                m = pl.max()
                m_use = 0.0 if m == -np.inf else m
                w = np.exp(pl - m_use)
                ssum = w.sum()
                inv = 1.0 / ssum if ssum > 0 else (0.0 if ssum == 0 else ssum)
                out[tok, head] = (w[:, None] * part_o[:, tok, head]).sum(axis=0) * inv
                with np.errstate(divide="ignore"):
                    out_l[tok, head] = m_use + np.log(ssum)
                mcounts[tok, head] += 1
    return out, out_l, mcounts


def prefill_row_frags(num_qo, group, batch):
    """launch_typed<T, D>: the 128-row CTA (2 fragments per warp) when the mean request has more than 64 rows."""
    return 2 if num_qo * group > 64 * batch else 1


def valid_rows(qo_indptr, num_qo):
    """Tokens of valid query ranges (the rows a launch must write once)."""
    want = np.zeros(num_qo, dtype=np.int64)
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if 0 <= q0 <= q1 <= num_qo:
            want[q0:q1] += 1
    return want


def run_case(d, hq, hkv, page_size, qo_lens, kv_lens, causal, splits, seed, empty=(), bug=None):
    q, qo_indptr, kv, scale, ref_out, ref_lse = prefill_case(
        d, hq, hkv, page_size, qo_lens, kv_lens, causal, seed, empty
    )
    indptr, indices, last = (x.numpy() for x in kv.table)
    out, lse, counts = emulate_prefill(
        q.numpy(),
        qo_indptr.numpy(),
        kv.k_cache.numpy(),
        kv.v_cache.numpy(),
        indptr,
        indices,
        last,
        causal,
        scale,
        splits,
        bug=bug,
    )
    return out, lse, counts, ref_out, ref_lse, qo_indptr.numpy(), q.shape[0]


def check(out, lse, counts, ref_out, ref_lse, qo_indptr, num_qo):
    assert (counts == valid_rows(qo_indptr, num_qo)[:, None]).all(), "each valid row written exactly once"
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=0)  # the reference's lse is float32


# ragged lengths: qo_len 1, a 64-token tile boundary, a request past one 128-row tile, page boundaries
CASES = [
    # d, hq, hkv, page, qo_lens, kv_lens (prefix = kv - qo), causal, splits
    (64, 2, 2, 1, [1, 37, 130, 5], [1, 101, 133, 205], True, 1),  # GQA 1, page 1: 130 rows > one tile
    (64, 6, 2, 3, [1, 23, 44, 9], [1, 64, 50, 65], True, 1),  # GQA 3 (rows straddle fragments), page 3
    (64, 6, 2, 3, [3, 23, 44], [70, 64, 50], False, 2),  # non-causal, 2 splits
    (128, 8, 1, 16, [1, 16, 17, 40], [16, 17, 48, 129], True, 1),  # GQA 8 (4 tokens per fragment), page 16
    (64, 8, 1, 16, [1, 33, 20], [200, 100, 150], True, 3),  # causal + 3 splits (empty trailing splits)
]


@pytest.mark.parametrize("d,hq,hkv,page_size,qo_lens,kv_lens,causal,splits", CASES)
def test_prefill_cta_matches_reference(d, hq, hkv, page_size, qo_lens, kv_lens, causal, splits):
    check(*run_case(d, hq, hkv, page_size, qo_lens, kv_lens, causal, splits, seed=d + hq + page_size + splits))


@pytest.mark.parametrize("splits", [1, 2])
def test_prefill_empty_kv_range(splits):
    """A request with no pages (non-causal: kv_len 0) gives out 0, lse -inf; its neighbours are right."""
    out, lse, counts, ref_out, ref_lse, qo_indptr, num_qo = run_case(
        64, 6, 2, 3, [5, 40, 3], [70, 40, 200], False, splits, seed=7, empty=(1,)
    )
    check(out, lse, counts, ref_out, ref_lse, qo_indptr, num_qo)
    assert (out[5:45] == 0).all() and (lse[5:45] == -np.inf).all()


def test_prefill_bad_page_table_is_nan():
    """A bad page index, and (causal) qo_len > kv_len: that request's rows are NaN, the others right; a qo range
    past num_qo gets no tile (never written)."""
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([50, 90, 10, 30], 16, 2, 64, torch.float64, "cpu", gen=gen)
    indptr, indices, last = (x.numpy().copy() for x in kv.table)
    indices[indptr[1] + 2] = kv.k_cache.shape[0] + 5  # request 1: a page past the pool
    qo_lens = [20, 40, 12, 7]  # request 2: 12 queries on 10 keys (causal: bad)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    num_qo = int(qo_indptr[-1])
    q = torch.randn((num_qo, 4, 64), generator=gen, dtype=torch.float64).numpy()
    out, lse, counts = emulate_prefill(
        q, qo_indptr, kv.k_cache.numpy(), kv.v_cache.numpy(), indptr, indices, last, True, 0.125
    )
    assert (counts == 1).all()
    assert np.isnan(out[20:72]).all() and np.isnan(lse[20:72]).all()
    good = np.r_[0:20, 72:79]
    # the reference on the good requests only (0 and 3; 1 and 2 given no queries), on the unmodified table
    ref_out, ref_lse = torch.zeros((27, 4, 64), dtype=torch.float64), torch.zeros((27, 4), dtype=torch.float64)
    sel = torch.tensor([0, 20, 20, 20, 27], dtype=torch.int32)
    reference.paged_prefill_attention(
        torch.from_numpy(q[good]), sel, kv.k_cache, kv.v_cache, *kv.table, True, 0.125, ref_out, ref_lse
    )
    np.testing.assert_allclose(out[good], ref_out.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse[good], ref_lse.numpy(), rtol=1e-6, atol=0)
    bad_range = qo_indptr.copy()
    bad_range[3] = num_qo + 9  # request 2 ends past num_qo, request 3 starts there: neither gets a tile
    _, _, counts = emulate_prefill(
        q, bad_range, kv.k_cache.numpy(), kv.v_cache.numpy(), indptr, indices, last, False, 0.125
    )
    assert (counts[: bad_range[2]] == 1).all() and (counts[bad_range[2] :] == 0).all()


def test_shared_prefix_cta_matches_reference():
    """shared_prefix_attention runs the same CTA: group g's rows against its prefix, non-causal."""
    gen = torch.Generator().manual_seed(11)
    kv = make_paged_kv([130, 7], 16, 2, 64, torch.float64, "cpu", gen=gen)
    group_indptr = torch.tensor([0, 70, 75], dtype=torch.int32)
    q = torch.randn((75, 8, 64), generator=gen, dtype=torch.float64)
    out, lse, _ = emulate_prefill(
        q.numpy(),
        group_indptr.numpy(),
        kv.k_cache.numpy(),
        kv.v_cache.numpy(),
        *(x.numpy() for x in kv.table),
        False,
        0.125,
    )
    ref_out, ref_lse = torch.empty_like(q), torch.empty((75, 8), dtype=torch.float64)
    reference.shared_prefix_attention(q, group_indptr, kv.k_cache, kv.v_cache, *kv.table, 0.125, ref_out, ref_lse)
    np.testing.assert_allclose(out, ref_out.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse.numpy(), rtol=1e-6, atol=0)


def test_one_fragment_matches_reference():
    """The same replay with rf = 1 (the 16-row fragment, Q in registers: the 4 x 1 x 1 CTA) agrees."""
    gen = torch.Generator().manual_seed(5)
    kv = make_paged_kv([40, 70], 3, 1, 64, torch.float64, "cpu", gen=gen)
    qo_indptr = np.array([0, 9, 30])
    q = torch.randn((30, 3, 64), generator=gen, dtype=torch.float64)
    out, lse, _ = emulate_prefill(
        q.numpy(), qo_indptr, kv.k_cache.numpy(), kv.v_cache.numpy(), *(x.numpy() for x in kv.table), True, 0.125, rf=1
    )
    ref_out, ref_lse = torch.empty_like(q), torch.empty((30, 3), dtype=torch.float64)
    reference.paged_prefill_attention(
        q, torch.from_numpy(qo_indptr).int(), kv.k_cache, kv.v_cache, *kv.table, True, 0.125, ref_out, ref_lse
    )
    np.testing.assert_allclose(out, ref_out.numpy(), rtol=1e-10, atol=1e-12)


def test_short_extends_take_64_row_tiles():
    """Short extends (mean <= 64 rows per request) run the one-fragment CTA, long prefills the 32-row warps."""
    assert prefill_row_frags(2048 * 8, 4, 8) == 2 and prefill_row_frags(16 * 8, 4, 8) == 1
    assert prefill_row_frags(65, 1, 1) == 2 and prefill_row_frags(64, 1, 1) == 1
    gen = torch.Generator().manual_seed(9)
    qo_lens = [1, 3, 2, 9]
    kv = make_paged_kv([150, 70, 64, 90], 16, 1, 64, torch.float64, "cpu", gen=gen)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = torch.randn((15, 4, 64), generator=gen, dtype=torch.float64)
    rf = prefill_row_frags(15, 4, 4)
    assert rf == 1
    out, lse, counts = emulate_prefill(
        q.numpy(), qo_indptr, kv.k_cache.numpy(), kv.v_cache.numpy(), *(x.numpy() for x in kv.table), True, 0.125, rf=rf
    )
    ref_out, ref_lse = torch.empty_like(q), torch.empty((15, 4), dtype=torch.float64)
    reference.paged_prefill_attention(
        q, torch.from_numpy(qo_indptr).int(), kv.k_cache, kv.v_cache, *kv.table, True, 0.125, ref_out, ref_lse
    )
    check(out, lse, counts, ref_out.numpy(), ref_lse.numpy(), qo_indptr, 15)


@pytest.mark.parametrize(
    "bug,splits",
    [
        ("q-fragment-offset", 1),
        ("swap-row-halves", 1),
        ("need-mask-last-row", 1),
        ("cta-row-beg-64", 1),
        ("merge-tile-height-64", 2),
    ],
)
def test_index_bugs_are_caught(bug, splits):
    """Each deliberate error in the new index math makes the comparison fail (the emulation has teeth): the second
    fragment's Q rows at + 8 instead of + 16, the thread's row halves swapped (rows + 16 / + 8), need_mask from
    the thread's last row instead of its first, the CTA's or the split merge's tile height left at 64 rows."""
    case = run_case(64, 6, 2, 3, [1, 23, 44, 9], [1, 64, 50, 65], True, splits, seed=21, bug=bug)
    with pytest.raises(AssertionError):
        check(*case)
