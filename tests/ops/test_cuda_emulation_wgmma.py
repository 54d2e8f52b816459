"""Numpy emulation of the Hopper wgmma prefill kernel (csrc/cuda/attention_wgmma.cu), without a GPU.

Two halves, kept apart on purpose:
- the HARDWARE, as the PTX ISA defines it ("Matrix Descriptor Format", the canonical K-major / MN-major
  layouts with 128-byte swizzling, the register fragments of wgmma .m64nNk16): `decode_desc`,
  `hw_read_kmajor`, `hw_read_mnmajor`, `acc_from_matrix`, `a_matrix_from_regs` read shared memory and
  registers the way wgmma would, knowing nothing of the kernel;
- the KERNEL's index math, mirrored line by line: `sw128_elem` (where the cp.async loaders write each
  16-byte chunk), `make_desc` / `desc_add` and the byte offsets per k-step / stage / warpgroup, the
  accumulator -> P (register A) packing, the per-thread rows, causal limits, online softmax, epilogue.
The whole tile loop runs on a byte-addressed shared-memory image (with the kernel's 1024-byte base
alignment) fed by the K/V loader emulation of tests/helpers/cuda_emulation.py (8 warps), over the tile map /
locate_tile of the ragged launch, in float64 against minisched.ops.reference.paged_prefill_attention.
`bug` injects a deliberate index error; test_index_bugs_are_caught checks that each one fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.cuda_emulation import BLOCK_N, emulate_loader, locate_tile, prefill_case, tile_map
from helpers.paged_kv import make_paged_kv

ROWS, THREADS, WARPS = 128, 256, 8  # the CTA: 2 warpgroups x 64 rows
T = np.arange(128)  # threads of one warpgroup
W4, LANE = T >> 5, T & 31
GR, CQ = LANE >> 2, LANE & 3  # fragment row (lane / 4) and column pair (lane % 4)


# -- the hardware (PTX ISA) ---------------------------------------------------------------------------------


def decode_desc(desc):
    """Matrix descriptor fields: start address, LBO, SBO (bytes), base offset, swizzle mode (1 = 128B)."""
    return (
        (desc & 0x3FFF) << 4,
        ((desc >> 16) & 0x3FFF) << 4,
        ((desc >> 32) & 0x3FFF) << 4,
        (desc >> 49) & 7,
        desc >> 62,
    )


def swizzle(addr, mode):
    """128B swizzle: 16-byte chunk bits [4, 7) ^= bits [7, 10) of the address (cute Swizzle<3,4,3>)."""
    assert mode in (0, 1)
    return addr ^ (((addr >> 7) & 7) << 4) if mode == 1 else addr


def _elements(smem, addr):
    """16-bit elements at byte addresses; outside the CTA's shared memory: NaN (garbage)."""
    assert (addr % 2 == 0).all()
    inside = (addr >= 0) & (addr // 2 < len(smem))
    return np.where(inside, smem[np.where(inside, addr // 2, 0)], np.nan)


def hw_read_kmajor(smem, desc, rows):
    """The [rows, 16] operand a k16 wgmma reads from a K-major descriptor. 128B swizzle: ((8, n), 2) :
    ((8, SBO), 1) in 16-byte units (row m at (m % 8) * 128 + (m / 8) * SBO, LBO unused); no swizzle:
    ((8, n), 2) : ((1, SBO), LBO) (core matrices of 8 rows x 16 bytes)."""
    start, lbo, sbo, base_off, mode = decode_desc(desc)
    assert base_off == 0
    m, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    if mode == 1:
        addr = start + (m % 8) * 128 + (m // 8) * sbo + 2 * k
    else:
        addr = start + (m % 8) * 16 + (m // 8) * sbo + (k // 8) * lbo + 2 * (k % 8)
    return _elements(smem, swizzle(addr, mode))


def hw_read_mnmajor(smem, desc, n_cols):
    """The [16, n_cols] operand B read with the transpose bit (MN-major). 128B swizzle: ((8, n), (8, k)) :
    ((1, LBO), (8, SBO)) in 16-byte units: 64 N-elements contiguous, the next 64 at LBO; K-rows 128 bytes
    apart, the next 8 K-rows at SBO. No swizzle: ((1, n), (8, k)) : ((X, SBO), (1, LBO)) (core matrices of
    8 N-elements x 8 K-rows, 16 bytes per K-row)."""
    start, lbo, sbo, base_off, mode = decode_desc(desc)
    assert base_off == 0
    k, n = np.meshgrid(np.arange(16), np.arange(n_cols), indexing="ij")
    if mode == 1:
        addr = start + (n // 64) * lbo + 2 * (n % 64) + (k % 8) * 128 + (k // 8) * sbo
    else:
        addr = start + (n // 8) * sbo + 2 * (n % 8) + (k % 8) * 16 + (k // 8) * lbo
    return _elements(smem, swizzle(addr, mode))


def acc_from_matrix(M):
    """Accumulator fragment of m64nN f32: thread t (warp w, lane) register 4 j + 2 h + e = M[16 w + lane / 4
    + 8 h, 8 j + 2 (lane % 4) + e]."""
    n = M.shape[1]
    regs = np.empty((128, n // 2))
    for j in range(n // 8):
        for h in range(2):
            for e in range(2):
                regs[:, 4 * j + 2 * h + e] = M[16 * W4 + GR + 8 * h, 8 * j + 2 * CQ + e]
    return regs


def a_matrix_from_regs(a):
    """Register A of m64nNk16 (16-bit): a[t, i, e], i = a0..a3: rows 16 w + lane / 4 (+ 8 for a1, a3), columns
    2 (lane % 4) + e (+ 8 for a2, a3)."""
    A = np.full((64, 16), np.nan)
    for i in range(4):
        for e in range(2):
            A[16 * W4 + GR + 8 * (i & 1), 2 * CQ + e + 8 * (i >> 1)] = a[:, i, e]
    assert not np.isnan(A).any(), "every A element comes from exactly one register"
    return A


def wgmma_ss(d, desc_a, desc_b, smem, accumulate):
    """m64n64k16, A and B K-major from shared memory: D = (accumulate ? D : 0) + A B^T."""
    prod = acc_from_matrix(hw_read_kmajor(smem, desc_a, 64) @ hw_read_kmajor(smem, desc_b, 64).T)
    return d + prod if accumulate else prod


def wgmma_rs(d, a, desc_b, smem, n_cols, trans_b=True):
    """m64n{N}k16, A from registers, B from shared memory (trans_b: MN-major, else K-major [N, 16])."""
    B = hw_read_mnmajor(smem, desc_b, n_cols) if trans_b else hw_read_kmajor(smem, desc_b, n_cols).T
    return d + acc_from_matrix(a_matrix_from_regs(a) @ B)


# -- the kernel's index math (attention_wgmma.cu, wgmma_utils.cuh) ----------------------------------------


def sw128_elem(r, c, R, bug=None):
    """wgmma::sw128_elem: element offset of (row r, 16-byte chunk c) in an R-row tile of [c / 8][R][64]."""
    x = c & 7 if bug == "no-swizzle-xor" else (c & 7) ^ (r & 7)
    return ((c >> 3) * R + r) * 64 + (x << 3)


def make_desc(addr, lbo, sbo, bug=None):
    mode = 0 if bug == "swizzle-mode-none" else 1
    return ((addr >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32) | (mode << 62)


def desc_add(desc, nbytes):
    assert nbytes % 16 == 0
    return desc + (nbytes >> 4)


def smem_layout(d, raw_addr):
    """The dynamic shared memory: base aligned up to 1024 bytes; Q, 2 K stages, 2 V stages (byte addresses)."""
    q_bytes, stage = ROWS * d * 2, BLOCK_N * d * 2
    total = q_bytes + 4 * stage + 1024  # wgmma_smem_bytes<D>()
    base = raw_addr + ((1024 - (raw_addr & 1023)) & 1023)
    assert base % 1024 == 0 and base + q_bytes + 4 * stage <= raw_addr + total
    return base, base + q_bytes, base + q_bytes + 2 * stage, stage, total


def emulate_cta(d, q_rows, fill, s_end, scale_log2, limit_of, bug=None, raw_addr=16 * 37):
    """One CTA: q_rows [128, d] (zero past the valid rows), fill(t) -> {(row, chunk): (k8, v8)} of tile t (as the
    loader copies it), limit_of(rows) the causal / length limit of CTA rows. Returns o [128, d], lse [128]."""
    ch, ks_n = d // 8, d // 16
    sq, sk, sv, stage_bytes, total = smem_layout(d, raw_addr)
    smem = np.full((raw_addr + total) // 2 + 1, np.nan)
    owner = np.zeros(len(smem), dtype=np.int64)
    for r in range(ROWS):  # the Q loop: idx = r * CH + c over the 256 threads
        for c in range(ch):
            e = sq // 2 + sw128_elem(r, c, ROWS, bug)
            smem[e : e + 8] = q_rows[r, 8 * c : 8 * c + 8]
            owner[e : e + 8] += 1
    assert owner.max() <= 1, "Q chunks overlap"

    def load(t):  # copy_kv_to(sK + stage * KV_ELEMS, sV + ..., sw128_elem(r, c, 64))
        off = (t & 1) * stage_bytes // 2
        for (r, c), (k8, v8) in fill(t).items():
            e = sw128_elem(r, c, BLOCK_N, bug)
            smem[sk // 2 + off + e : sk // 2 + off + e + 8] = k8
            smem[sv // 2 + off + e : sv // 2 + off + e + 8] = v8

    n_tiles = -(-s_end // BLOCK_N) if s_end > 0 else 0
    if n_tiles > 0:
        load(0)
    o_all, lse_all = np.full((ROWS, d), np.nan), np.full(ROWS, np.nan)
    written = np.zeros(ROWS, dtype=np.int64)
    # per warpgroup: descriptors, rows, limits and registers; both run tile t on the same stage
    states = []
    for wg in range(2):
        q_off = 0 if bug == "no-warpgroup-row-offset" else wg * 64 * 128
        dq = make_desc(sq + q_off, 16, 1024, bug)
        dk = make_desc(sk, 16, 1024, bug)
        lbo, sbo = (1024, BLOCK_N * 128) if bug == "lbo-sbo-swapped" else (BLOCK_N * 128, 1024)
        dv = make_desc(sv, lbo, sbo, bug)
        trow0 = (0 if bug == "causal-rows-without-wg" else wg * 64) + (W4 & 3) * 16 + GR
        rows = [wg * 64 + (W4 & 3) * 16 + GR + 8 * h for h in range(2)]
        lim = [np.minimum(s_end, limit_of(trow0 + 8 * h) + 1) - 1 for h in range(2)]
        states.append(
            dict(
                dq=dq,
                dk=dk,
                dv=dv,
                rows=rows,
                lim=lim,
                o=np.zeros((128, d // 2)),
                s=np.zeros((128, 32)),
                m=np.full((128, 2), -np.inf),
                l=np.zeros((128, 2)),
            )
        )
    for t in range(n_tiles):
        if t + 1 < n_tiles:
            load(t + 1)  # issued before tile t's compute, into the other stage
        stage_off = (t & 1) * stage_bytes
        for st in states:
            s = st["s"]
            for ks in range(ks_n):
                kstep = 16 if bug == "kstep-16-bytes" else 32
                koff = (ks >> 2) * 8192 + (ks & 3) * kstep
                s = wgmma_ss(
                    s,
                    desc_add(st["dq"], (ks >> 2) * ROWS * 128 + (ks & 3) * kstep),
                    desc_add(st["dk"], stage_off + koff),
                    smem,
                    ks > 0,
                )
            tok0 = t * BLOCK_N + 2 * CQ
            need_mask = t * BLOCK_N + BLOCK_N - 1 > st["lim"][0]
            for h in range(2):
                cols = [4 * j + 2 * h + e for j in range(8) for e in range(2)]
                v = s[:, cols] * scale_log2
                tok = tok0[:, None] + np.array([8 * j + e for j in range(8) for e in range(2)])[None, :]
                v = np.where(need_mask[:, None] & (tok > st["lim"][h][:, None]), -np.inf, v)
                mx = v.max(axis=1)
                mx = np.maximum(mx, mx[T ^ 1])
                mx = np.maximum(mx, mx[T ^ 2])
                m_new = np.maximum(st["m"][:, h], mx)
                m_use = np.where(m_new == -np.inf, 0.0, m_new)
                alpha = np.exp2(st["m"][:, h] - m_use)
                st["m"][:, h] = m_new
                p = np.exp2(v - m_use[:, None])
                s[:, cols] = p
                st["l"][:, h] = st["l"][:, h] * alpha + p.sum(axis=1)
                ocols = [4 * j + 2 * h + e for j in range(d // 8) for e in range(2)]
                st["o"][:, ocols] *= alpha[:, None]
            st["s"] = s
            # P: pa[kb][i] = (s[8 kb + 2 i], s[8 kb + 2 i + 1]) (16-bit pairs; float64 here)
            pa = np.stack([s[:, 8 * kb : 8 * kb + 8].reshape(128, 4, 2) for kb in range(4)], axis=1)
            if bug == "p-fragment-swap":
                pa = pa[:, :, [0, 2, 1, 3], :]
            for kb in range(4):
                st["o"] = wgmma_rs(
                    st["o"],
                    pa[:, kb],
                    desc_add(st["dv"], stage_off + kb * 2048),
                    smem,
                    d,
                    trans_b=bug != "transpose-off",
                )
    for st in states:  # epilogue
        for h in range(2):
            l = st["l"][:, h]
            l = l + l[T ^ 1]
            l = l + l[T ^ 2]
            inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1.0), 0.0)
            with np.errstate(divide="ignore"):
                lse = np.where(l > 0, (st["m"][:, h] + np.log2(np.where(l > 0, l, 1.0))) * np.log(2.0), -np.inf)
            r = st["rows"][h]
            for j in range(d // 8):
                for e in range(2):
                    o_all[r, 8 * j + 2 * CQ + e] = st["o"][:, 4 * j + 2 * h + e] * inv
            lse_all[r] = lse
            np.add.at(written, r[CQ == 0], 1)
    assert (written == 1).all(), "every CTA row is owned by exactly one lane quad"
    return o_all, lse_all


def emulate_prefill(q, qo_indptr, k_cache, v_cache, indptr, indices, last, causal, scale, bug=None):
    """The ragged launch: tile map (128-row tiles), grid = host bound x kv heads, one split. Returns out, lse
    (NaN where never written) and per-row write counts."""
    num_qo, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    g, batch, nnz = hq // hkv, len(qo_indptr) - 1, len(indices)
    offsets = tile_map(qo_indptr, num_qo, g, ROWS)
    grid_x = -(-num_qo * g // ROWS) + batch
    assert offsets[batch] <= grid_x
    kflat, vflat = k_cache.reshape(-1), v_cache.reshape(-1)
    out, out_l = np.full((num_qo, hq, d), np.nan), np.full((num_qo, hq), np.nan)
    counts = np.zeros((num_qo, hq), dtype=np.int64)
    for kvh in range(hkv):
        for x in range(grid_x):
            ok, b, tile, q_start, qo_len = locate_tile(x, qo_indptr, offsets, 0)
            if not ok:
                continue
            row_beg = tile * ROWS
            rows_valid = min(ROWS, qo_len * g - row_beg)
            kv_beg, kv_endp, lst = int(indptr[b]), int(indptr[b + 1]), int(last[b])
            bad = not (0 <= kv_beg <= kv_endp <= nnz and 1 <= lst <= page_size)
            kv_len = (kv_endp - kv_beg - 1) * page_size + lst if kv_endp > kv_beg else 0
            bad = bad or kv_len > 0x7FFFFFFF or (causal and kv_len < qo_len)
            kv_len = 0 if bad else kv_len
            s_end = kv_len
            if causal and rows_valid > 0:
                s_end = min(s_end, kv_len - qo_len + (row_beg + rows_valid - 1) // g + 1)
            if bad or s_end <= 0:
                s_end = 0

            def limit_of(r, kv_len=kv_len, qo_len=qo_len, row_beg=row_beg):
                return kv_len - qo_len + (row_beg + r) // g if causal else np.full_like(r, kv_len - 1)

            q_rows = np.zeros((ROWS, d))
            for r in range(rows_valid if not bad else 0):
                pr = row_beg + r
                q_rows[r] = q[q_start + pr // g, kvh * g + pr % g]
            flags = []

            def fill(t, s_end=s_end, kv_beg=kv_beg, flags=flags):
                copies, bad_page = emulate_loader(
                    WARPS, d, page_size, hkv, kvh, indices, kv_beg, num_pages, t * BLOCK_N, s_end
                )
                flags.append(bad_page)
                assert len(copies) == BLOCK_N * d // 8, "the 8-warp loader writes every (row, chunk) once"
                z = np.zeros(8)
                return {
                    rc: (z, z) if src is None else (kflat[src : src + 8], vflat[src : src + 8])
                    for rc, src in copies.items()
                }

            o, lse = emulate_cta(d, q_rows, fill, s_end, scale * np.log2(np.e), limit_of, bug)
            cta_bad = bad or any(flags)
            for r in range(rows_valid):
                pr = row_beg + r
                tok, head = q_start + pr // g, kvh * g + pr % g
                out[tok, head] = np.nan if cta_bad else o[r]
                out_l[tok, head] = np.nan if cta_bad else lse[r]
                counts[tok, head] += 1
    return out, out_l, counts


# -- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
def test_descriptors_read_what_the_loaders_wrote(d):
    """Every k-step's Q / K descriptor (both warpgroups, both stages) reads exactly the logical 64 x 16 slice,
    every P V k-step's V descriptor the 16 x d slice, from the swizzled image the loaders write."""
    rng = np.random.default_rng(d)
    sq, sk, sv, stage_bytes, total = smem_layout(d, 16 * 5)
    smem = np.full((16 * 5 + total) // 2 + 1, np.nan)
    Q = rng.standard_normal((ROWS, d))
    KV = [(rng.standard_normal((BLOCK_N, d)), rng.standard_normal((BLOCK_N, d))) for _ in range(2)]
    for r in range(ROWS):
        for c in range(d // 8):
            e = sq // 2 + sw128_elem(r, c, ROWS)
            smem[e : e + 8] = Q[r, 8 * c : 8 * c + 8]
    for st, (K, V) in enumerate(KV):
        for r in range(BLOCK_N):
            for c in range(d // 8):
                e = sw128_elem(r, c, BLOCK_N) + st * stage_bytes // 2
                smem[sk // 2 + e : sk // 2 + e + 8] = K[r, 8 * c : 8 * c + 8]
                smem[sv // 2 + e : sv // 2 + e + 8] = V[r, 8 * c : 8 * c + 8]
    assert decode_desc(make_desc(sk, 16, 1024)) == (sk, 16, 1024, 0, 1)
    assert decode_desc(make_desc(sv, BLOCK_N * 128, 1024)) == (sv, 8192, 1024, 0, 1)
    for wg in range(2):
        dq = make_desc(sq + wg * 64 * 128, 16, 1024)
        for ks in range(d // 16):
            a = hw_read_kmajor(smem, desc_add(dq, (ks >> 2) * ROWS * 128 + (ks & 3) * 32), 64)
            np.testing.assert_array_equal(a, Q[64 * wg : 64 * wg + 64, 16 * ks : 16 * ks + 16])
    for st, (K, V) in enumerate(KV):
        for ks in range(d // 16):
            koff = st * stage_bytes + (ks >> 2) * 8192 + (ks & 3) * 32
            b = hw_read_kmajor(smem, desc_add(make_desc(sk, 16, 1024), koff), 64)
            np.testing.assert_array_equal(b, K[:, 16 * ks : 16 * ks + 16])
        for kb in range(4):
            v = hw_read_mnmajor(smem, desc_add(make_desc(sv, BLOCK_N * 128, 1024), st * stage_bytes + kb * 2048), d)
            np.testing.assert_array_equal(v, V[16 * kb : 16 * kb + 16])


def test_accumulator_converts_to_register_a():
    """P's accumulator registers, packed as the kernel does (pa[kb][i] = s[8 kb + 2 i], s[8 kb + 2 i + 1]), are
    the register-A fragments of the 64 x 16 column slices of P."""
    P = np.random.default_rng(1).standard_normal((64, 64))
    s = acc_from_matrix(P)
    for kb in range(4):
        pa = s[:, 8 * kb : 8 * kb + 8].reshape(128, 4, 2)
        np.testing.assert_array_equal(a_matrix_from_regs(pa), P[:, 16 * kb : 16 * kb + 16])


def run_case(d, hq, hkv, page_size, qo_lens, kv_lens, causal, seed, empty=(), bug=None):
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
        bug=bug,
    )
    assert (counts == 1).all(), "each row written exactly once"
    return out, lse, ref_out, ref_lse


def check(out, lse, ref_out, ref_lse):
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=0)  # the reference's lse is float32


CASES = [
    # d, hq, hkv, page, qo_lens, kv_lens (prefix = kv - qo), causal
    (64, 2, 2, 1, [1, 37, 130, 5], [1, 101, 133, 205], True),  # GQA 1, page 1: 130 rows > one tile
    (128, 2, 2, 16, [70, 64, 1], [70, 130, 64], True),  # GQA 1, D 128: rows in both warpgroups
    (64, 8, 2, 3, [1, 23, 9, 17], [1, 64, 65, 80], True),  # GQA 4, page 3, tile boundaries 64 / 65
    (128, 8, 1, 16, [1, 16, 17, 40], [16, 17, 48, 129], True),  # GQA 8 (16 tokens per 128-row tile)
    (128, 8, 1, 16, [3, 20], [150, 20], False),  # non-causal
    (64, 4, 4, 3, [5, 70], [100, 70], False),  # GQA 1, several kv heads, non-causal
]


@pytest.mark.parametrize("d,hq,hkv,page_size,qo_lens,kv_lens,causal", CASES)
def test_wgmma_cta_matches_reference(d, hq, hkv, page_size, qo_lens, kv_lens, causal):
    check(*run_case(d, hq, hkv, page_size, qo_lens, kv_lens, causal, seed=d + hq + page_size))


@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_empty_kv_range(d):
    """A request with no pages (non-causal: kv_len 0) gives out 0, lse -inf; its neighbours are right."""
    out, lse, ref_out, ref_lse = run_case(d, 8, 2, 16, [5, 40, 3], [70, 40, 200], False, seed=7, empty=(1,))
    check(out, lse, ref_out, ref_lse)
    assert (out[5:45] == 0).all() and (lse[5:45] == -np.inf).all()


def test_wgmma_bad_page_is_nan():
    """A page index past the pool: that request's rows are NaN (never read), the others right."""
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([50, 90, 30], 16, 2, 64, torch.float64, "cpu", gen=gen)
    indptr, indices, last = (x.numpy().copy() for x in kv.table)
    indices[indptr[1] + 2] = kv.k_cache.shape[0] + 5
    qo_indptr = np.array([0, 20, 60, 67])
    q = torch.randn((67, 4, 64), generator=gen, dtype=torch.float64).numpy()
    out, lse, counts = emulate_prefill(
        q, qo_indptr, kv.k_cache.numpy(), kv.v_cache.numpy(), indptr, indices, last, True, 0.125
    )
    assert (counts == 1).all()
    assert np.isnan(out[20:60]).all() and np.isnan(lse[20:60]).all()
    assert not np.isnan(out[:20]).any() and not np.isnan(out[60:]).any()


BUGS = [
    "no-swizzle-xor",
    "swizzle-mode-none",
    "lbo-sbo-swapped",
    "transpose-off",
    "kstep-16-bytes",
    "no-warpgroup-row-offset",
    "p-fragment-swap",
    "causal-rows-without-wg",
]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bug", BUGS)
def test_index_bugs_are_caught(bug, d):
    """Each deliberate error in the kernel's index math makes the emulation disagree with the reference."""
    with pytest.raises(AssertionError):
        check(*run_case(d, 2, 2, 16, [100, 30], [120, 90], True, seed=11, bug=bug))


# The expressions of attention_wgmma.cu / wgmma_utils.cuh that this file mirrors: editing one of them in the
# kernel fails here until the emulation above is updated with it.
KERNEL_SOURCE_MIRRORED = {
    "wgmma_utils.cuh": [
        "return ((c >> 3) * R + r) * 64 + (((c & 7) ^ (r & 7)) << 3);",
        "return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |",
        "(uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | kSwizzle128;",
        "constexpr uint64_t kSwizzle128 = uint64_t(1) << 62;",
        '"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MS_R32 ", %32, %33, p, 1, 1, 0, 0;',
        '", {%64, %65, %66, %67}, %68, p, 1, 1, 1;',
    ],
    "attention_wgmma.cu": [
        "unsigned char* base = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);",
        "cp_async_16(sQ + wgmma::sw128_elem(r, c, kRows), src, valid);",
        "auto kv_off = [](int r, int c) { return wgmma::sw128_elem(r, c, kBlockN); };",
        "const uint64_t dq = wgmma::make_desc(smem_addr(sQ) + wg * 64 * 128, 16, SBO);",
        "const uint64_t dk = wgmma::make_desc(smem_addr(sK), 16, SBO);",
        "const uint64_t dv = wgmma::make_desc(smem_addr(sV), kBlockN * 128, SBO);",
        "const uint32_t koff = (ks >> 2) * 8192 + (ks & 3) * 32;",
        "wgmma::mma_ss_n64<T>(s, wgmma::desc_add(dq, (ks >> 2) * kRows * 128 + (ks & 3) * 32),",
        "wgmma::desc_add(dk, stage_off + koff), ks > 0);",
        "wgmma::mma_rs<T, D>(o, pa[kb], wgmma::desc_add(dv, stage_off + kb * 2048));",
        "kv.copy_kv_to(sK + ((t + 1) & 1) * KV_ELEMS, sV + ((t + 1) & 1) * KV_ELEMS, kv_off);",
        "const int trow0 = wg * 64 + (warp & 3) * 16 + (lane >> 2);",
        "lim[h] = min(s_end, p.causal ? kv_len - qo_len + (row_beg + trow0 + 8 * h) / g + 1 : kv_len) - 1;",
        "const bool need_mask = t * kBlockN + kBlockN - 1 > lim[0];",
        "pa[kb][1] = pack2<T>(s[8 * kb + 2], s[8 * kb + 3]);",
        "pa[kb][2] = pack2<T>(s[8 * kb + 4], s[8 * kb + 5]);",
    ],
}


@pytest.mark.parametrize("name", sorted(KERNEL_SOURCE_MIRRORED))
def test_emulated_expressions_are_the_kernels(name):
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "cuda", name)
    src = " ".join(open(path).read().split())
    for expr in KERNEL_SOURCE_MIRRORED[name]:
        assert " ".join(expr.split()) in src, f"{name} no longer has `{expr}`: update the emulation with it"
