"""Numpy emulation of the CUDA decode CTA's warp-level math (runs without a GPU): split-K inside the CTA.

A CTA of paged_attention_kernel<T, D, ROW_WARPS, KV_WARPS> (csrc/cuda/attention_kernel.cu) has
ROW_WARPS x KV_WARPS warps; warp (rw, kw) owns query rows rw * 16.. and tokens kw * NW.. of every
64-token KV tile, keeps its own online-softmax state, and the KV warps merge (m, l, o) through shared
memory at the end. This file replays that line by line, per lane: the ldmatrix addresses (with the
sub-tile offset), the mma.sync m16n8k16 fragment layouts, the per-warp masking and online softmax, the
shared-memory merge (its index math, bounds and bank pattern), the epilogue and the split merge, with the
K/V tiles filled by the loader emulation, and checks the result against minisched.ops.reference in float64
(no rounding: what is checked is which element goes where). The loader and the ldmatrix / mma.sync
fragment helpers are in tests/helpers/cuda_emulation.py.
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
    mma_16816,
    quad_reduce,
)
from helpers.paged_kv import make_paged_kv, without_pages
from minisched.ops import reference

STAGES = 2


# -- one CTA --------------------------------------------------------------------------------------------


class MergeSmem:
    """The merge buffer over the K/V stages as a flat fp32 array: bounds, write-once and read-after-write."""

    def __init__(self, n_floats):
        self.val = np.full(n_floats, np.nan)
        self.written = np.zeros(n_floats, dtype=bool)

    def store(self, idx, v):
        assert (idx >= 0).all() and (idx < len(self.val)).all(), "merge buffer outside the K/V stages"
        assert not self.written[idx].any() and len(set(idx.tolist())) == len(idx), "merge slot written twice"
        self.val[idx], self.written[idx] = v, True

    def load(self, idx):
        assert self.written[idx].all(), "merge slot read before written"
        return self.val[idx]


def float2_banks_conflict_free(word_idx):
    """A warp's 64-bit stores run as two half-warp phases; each phase must hit 32 distinct banks."""
    for half in (slice(0, 16), slice(16, 32)):
        banks = np.concatenate([word_idx[half] % 32, (word_idx[half] + 1) % 32])
        if len(set(banks.tolist())) != 32:
            return False
    return True


def emulate_cta(row_warps, kv_warps, d, q_rows, fill_tile, s_beg, s_end, scale):
    """One CTA: q_rows [16 * row_warps, d] (packed (token, head) rows, zero past the valid ones), tiles
    filled by fill_tile(t, stage_k, stage_v). Returns per packed row (o normalized, lse natural log) as the
    epilogue of the warps kw = 0 computes them (out = o / l, lse = (m + log2 l) ln 2)."""
    sp, nw = d + 8, BLOCK_N // kv_warps
    nt, ks_n, dt = nw // 8, d // 16, d // 8
    rows_tile = 16 * row_warps
    sq = np.zeros(rows_tile * sp)
    for r in range(rows_tile):
        sq[r * sp : r * sp + d] = q_rows[r]
    sk = np.zeros(STAGES * BLOCK_N * sp)
    sv = np.zeros(STAGES * BLOCK_N * sp)
    n_tiles = 0 if s_end <= s_beg else -(-(s_end - s_beg) // BLOCK_N)
    scale_log2 = scale * np.log2(np.e)
    state = {}
    for t in range(n_tiles):
        st = t & 1
        fill_tile(
            t,
            sk[st * BLOCK_N * sp : (st + 1) * BLOCK_N * sp].reshape(BLOCK_N, sp),
            sv[st * BLOCK_N * sp : (st + 1) * BLOCK_N * sp].reshape(BLOCK_N, sp),
        )
        for warp in range(row_warps * kv_warps):
            kw = 0 if kv_warps == 1 else warp // row_warps
            rw = warp - kw * row_warps
            if t == 0:
                qa = [ldmatrix_x4(sq, (rw * 16 + (LANES & 15)) * sp + ks * 16 + (LANES >> 4) * 8) for ks in range(ks_n)]
                state[warp] = dict(qa=qa, o=np.zeros((dt, 32, 4)), m=np.full((2, 32), -np.inf), l=np.zeros((2, 32)))
            w = state[warp]
            k_base = (st * BLOCK_N + kw * nw) * sp  # k_s / v_s: the warp's sub-tile
            tok0 = s_beg + t * BLOCK_N + kw * nw
            s = np.zeros((nt, 32, 4))
            for ks in range(ks_n):
                for nb in range(nt // 2):
                    kb = ldmatrix_x4(
                        sk, k_base + (nb * 16 + (LANES & 7) + (LANES >> 4) * 8) * sp + ks * 16 + ((LANES >> 3) & 1) * 8
                    )
                    mma_16816(s[2 * nb], w["qa"][ks], kb[:, 0], kb[:, 1])
                    mma_16816(s[2 * nb + 1], w["qa"][ks], kb[:, 2], kb[:, 3])
            limit = s_end - 1  # decode: no causal limit; tokens past s_end are masked
            for j in range(nt):
                for e in range(4):
                    tok = tok0 + j * 8 + C * 2 + (e & 1)
                    v = s[j, :, e] * scale_log2
                    s[j, :, e] = np.where((tok >= s_end) | (tok > limit), -np.inf, v)
            for i in range(2):
                mx = quad_reduce(np.max(s[:, :, 2 * i : 2 * i + 2], axis=(0, 2)), np.maximum)
                m_new = np.maximum(w["m"][i], mx)
                m_use = np.where(m_new == -np.inf, 0.0, m_new)
                alpha = np.exp2(w["m"][i] - m_use)
                w["m"][i] = m_new
                s[:, :, 2 * i : 2 * i + 2] = np.exp2(s[:, :, 2 * i : 2 * i + 2] - m_use[None, :, None])
                w["l"][i] = w["l"][i] * alpha + s[:, :, 2 * i : 2 * i + 2].sum(axis=(0, 2))
                w["o"][:, :, 2 * i : 2 * i + 2] *= alpha[None, :, None]
            for kb_i in range(nt // 2):
                pa = np.stack(
                    [s[2 * kb_i][:, 0:2], s[2 * kb_i][:, 2:4], s[2 * kb_i + 1][:, 0:2], s[2 * kb_i + 1][:, 2:4]], axis=1
                )
                for dp in range(dt // 2):
                    vb = ldmatrix_x4_trans(
                        sv,
                        k_base + (kb_i * 16 + (LANES & 7) + ((LANES >> 3) & 1) * 8) * sp + dp * 16 + (LANES >> 4) * 8,
                    )
                    mma_16816(w["o"][2 * dp], pa, vb[:, 0], vb[:, 1])
                    mma_16816(w["o"][2 * dp + 1], pa, vb[:, 2], vb[:, 3])
    warps = row_warps * kv_warps
    for warp in range(warps):  # warps of an empty range never ran a tile
        state.setdefault(warp, dict(o=np.zeros((dt, 32, 4)), m=np.full((2, 32), -np.inf), l=np.zeros((2, 32))))
        state[warp]["l"] = np.stack([quad_reduce(state[warp]["l"][i], np.add) for i in range(2)])
    c2 = C * 2
    if kv_warps > 1:  # -- the shared-memory merge, index math as in the kernel --
        op = d + 8
        kv_region = 2 * STAGES * BLOCK_N * sp * 2 // 4  # floats in the K/V stages (16-bit elements)
        smem = MergeSmem(kv_region)
        s_m, s_l, s_o = 0, kv_warps * rows_tile, 2 * kv_warps * rows_tile
        for warp in range(warps):
            kw, w = warp // row_warps, state[warp]
            wrow0 = (warp - kw * row_warps) * 16 + G
            q0 = C == 0  # lanes (lane & 3) == 0
            for i in range(2):
                smem.store(s_m + kw * rows_tile + wrow0[q0] + 8 * i, w["m"][i][q0])
                smem.store(s_l + kw * rows_tile + wrow0[q0] + 8 * i, w["l"][i][q0])
        for warp in range(warps):  # __syncthreads(); every warp rescales to the row maximum
            kw, w = warp // row_warps, state[warp]
            wrow0 = (warp - kw * row_warps) * 16 + G
            for i in range(2):
                r = wrow0 + 8 * i
                ms = np.stack([smem.load(s_m + k * rows_tile + r) for k in range(kv_warps)])
                ls = np.stack([smem.load(s_l + k * rows_tile + r) for k in range(kv_warps)])
                mx = ms.max(axis=0)
                m_use = np.where(mx == -np.inf, 0.0, mx)
                f = np.exp2(w["m"][i] - m_use)
                w["o"][:, :, 2 * i : 2 * i + 2] *= f[None, :, None]
                w["m"][i], w["l"][i] = mx, (ls * np.exp2(ms - m_use)).sum(axis=0)
            if kw > 0:
                dst = s_o + ((kw - 1) * rows_tile + wrow0) * op + c2
                for i in range(2):
                    for j in range(dt):
                        idx = dst + 8 * i * op + j * 8
                        assert idx.min() % 2 == 0 and float2_banks_conflict_free(idx)
                        smem.store(
                            np.concatenate([idx, idx + 1]),
                            np.concatenate([w["o"][j, :, 2 * i], w["o"][j, :, 2 * i + 1]]),
                        )
        for warp in range(row_warps):  # __syncthreads(); warps kw = 0 add the others' o
            w, wrow0 = state[warp], warp * 16 + G
            for k in range(1, kv_warps):
                src = s_o + ((k - 1) * rows_tile + wrow0) * op + c2
                for i in range(2):
                    for j in range(dt):
                        idx = src + 8 * i * op + j * 8
                        w["o"][j, :, 2 * i] += smem.load(idx)
                        w["o"][j, :, 2 * i + 1] += smem.load(idx + 1)
    out, lse = np.full((rows_tile, d), np.nan), np.full(rows_tile, np.nan)
    for warp in range(row_warps):  # the epilogue of the warps kw = 0
        w, wrow0 = state[warp], warp * 16 + G
        for i in range(2):
            l_ = w["l"][i]
            inv = np.where(l_ > 0, 1.0 / np.where(l_ > 0, l_, 1.0), 0.0)
            lse_v = np.where(l_ > 0, (w["m"][i] + np.log2(np.where(l_ > 0, l_, 1.0))) * np.log(2.0), -np.inf)
            r = wrow0 + 8 * i
            for j in range(dt):
                out[r, j * 8 + c2] = w["o"][j, :, 2 * i] * inv
                out[r, j * 8 + c2 + 1] = w["o"][j, :, 2 * i + 1] * inv
            lse[r] = lse_v
    return out, lse


def emulate_decode(row_warps, kv_warps, q, k_cache, v_cache, indptr, indices, last, num_splits, scale):
    """The decode launch: CTAs over (request, row tile) x kv head x split, then merge_splits_kernel."""
    b_n, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    g, rows_tile = hq // hkv, 16 * row_warps
    kflat, vflat = k_cache.reshape(-1), v_cache.reshape(-1)
    part_o = np.full((num_splits, b_n, hq, d), np.nan)
    part_l = np.full((num_splits, b_n, hq), np.nan)
    for b in range(b_n):
        kv_beg, kv_end, lst = int(indptr[b]), int(indptr[b + 1]), int(last[b])
        kv_len = (kv_end - kv_beg - 1) * page_size + lst if kv_end > kv_beg else 0
        chunk = -(-kv_len // num_splits)
        chunk = -(-chunk // BLOCK_N) * BLOCK_N
        for tile in range(-(-g // rows_tile)):
            row_beg = tile * rows_tile
            rows_valid = min(rows_tile, g - row_beg)
            for kvh in range(hkv):
                q_rows = np.zeros((rows_tile, d))
                q_rows[:rows_valid] = q[b, kvh * g + row_beg : kvh * g + row_beg + rows_valid]
                for split in range(num_splits):
                    s_beg = split * chunk
                    s_end = min(kv_len, s_beg + chunk)

                    def fill(t, tk, tv, s_beg=s_beg, s_end=s_end, kvh=kvh):
                        copies, bad = emulate_loader(
                            row_warps * kv_warps,
                            d,
                            page_size,
                            hkv,
                            kvh,
                            indices,
                            kv_beg,
                            num_pages,
                            s_beg + t * BLOCK_N,
                            s_end,
                        )
                        assert not bad
                        for (r, c), src in copies.items():
                            tk[r, c * 8 : c * 8 + 8] = 0.0 if src is None else kflat[src : src + 8]
                            tv[r, c * 8 : c * 8 + 8] = 0.0 if src is None else vflat[src : src + 8]

                    o, lse = emulate_cta(row_warps, kv_warps, d, q_rows, fill, s_beg, s_end, scale)
                    heads = slice(kvh * g + row_beg, kvh * g + row_beg + rows_valid)
                    part_o[split, b, heads] = o[:rows_valid]
                    part_l[split, b, heads] = lse[:rows_valid]
    if num_splits == 1:
        return part_o[0], part_l[0]
    m = part_l.max(axis=0)  # merge_splits_kernel
    m_use = np.where(m == -np.inf, 0.0, m)
    w = np.exp(part_l - m_use)
    s = w.sum(axis=0)
    inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf: the empty range's lse
        return (w[..., None] * part_o).sum(axis=0) * inv[..., None], m_use + np.log(s)


# kv lengths: long (several tiles, a partial last one), < 16 (KV warps 1.. see no key at all), an empty
# range (request EMPTY gets no pages), one full tile, 17 (the second warp's sub-tile holds one key)
LENS = [200, 5, 9, 64, 17]
EMPTY = 2


@pytest.mark.parametrize(
    "row_warps,kv_warps,d,page_size,hq,hkv,splits",
    [
        (1, 4, 128, 16, 8, 2, 1),  # the decode case's CTA (GQA 4, D 128, page 16)
        (1, 4, 128, 16, 8, 2, 3),  # with KV splits
        (1, 4, 64, 1, 2, 2, 2),  # GQA 1, page 1
        (2, 2, 64, 3, 24, 1, 1),  # GQA 24: two row warps, two KV warps
        (2, 2, 128, 16, 32, 1, 2),
        (4, 1, 64, 16, 96, 1, 1),  # the GQA > 32 decode CTA (4 x 1, 16 rows per warp), two row tiles
    ],
)
def test_decode_cta_matches_reference(row_warps, kv_warps, d, page_size, hq, hkv, splits):
    gen = torch.Generator().manual_seed(row_warps * 100 + kv_warps * 10 + d + page_size)
    kv = without_pages(make_paged_kv(LENS, page_size, hkv, d, torch.float64, "cpu", gen=gen), {EMPTY})
    q = torch.randn((len(LENS), hq, d), generator=gen, dtype=torch.float64)
    scale = d**-0.5
    indptr, indices, last = (x.numpy() for x in kv.table)
    out, lse = emulate_decode(
        row_warps, kv_warps, q.numpy(), kv.k_cache.numpy(), kv.v_cache.numpy(), indptr, indices, last, splits, scale
    )
    ref_out, ref_lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float64)
    reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, *kv.table, scale, ref_out, ref_lse)
    np.testing.assert_allclose(out, ref_out.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse.numpy(), rtol=1e-6, atol=0)  # the reference's lse is float32
    assert (out[EMPTY] == 0).all() and (lse[EMPTY] == -np.inf).all()


@pytest.mark.parametrize("row_warps,kv_warps", [(1, 4), (2, 2)])
@pytest.mark.parametrize("d", [64, 128])
def test_merge_buffer_fits_in_kv_stages(row_warps, kv_warps, d):
    """merge_bytes (the kernel's static_assert) against the K/V stages it reuses."""
    rows_tile = 16 * row_warps
    merge = (2 * kv_warps * rows_tile + (kv_warps - 1) * rows_tile * (d + 8)) * 4
    assert merge <= 2 * STAGES * BLOCK_N * (d + 8) * 2
