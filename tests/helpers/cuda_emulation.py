"""Building blocks of the numpy emulations of the CUDA attention kernels (tests/ops/test_cuda_emulation*.py).

Mirrored from csrc/cuda/attention_kernel.cu line by line: the tile map (tile_map_kernel) and which request
and row tile a CTA column takes (locate_tile); the K/V loader (owned_tok / fetch_idx / make_bases / copy_kv)
as the cp.async copies of one 64-token tile. Per lane, as the PTX ISA defines them: ldmatrix(.trans)
x4, mma.sync m16n8k16 and the quad shuffle reduction. And `prefill_case`, a random float64 prefill batch with
the reference's answer, which the CTA emulations run on.
"""

from __future__ import annotations

import numpy as np
import torch

from helpers.paged_kv import make_paged_kv, without_pages
from minisched.ops import reference

# -- the block-level index math (tile_map_kernel, locate_tile) -------------------------------------------


def tile_map(qo_indptr, num_qo, group, rows_tile):
    """tile_map_kernel: tile_offsets[b] = sum of ceil(qo_len * group / rows_tile) over earlier requests;
    an invalid range (q0 < 0, q1 < q0, q1 > num_qo) gets no tiles."""
    batch = len(qo_indptr) - 1
    off = np.zeros(batch + 1, dtype=np.int64)
    for b in range(batch):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n = 0 if (q0 < 0 or q1 < q0 or q1 > num_qo) else -(-(q1 - q0) * group // rows_tile)
        off[b + 1] = off[b] + n
    return off


def locate_tile(x, qo_indptr, offsets, tiles_per_request):
    """locate_tile: (ok, b, tile, q_start, qo_len) of CTA column x."""
    if qo_indptr is None:
        return True, x // tiles_per_request, x % tiles_per_request, x // tiles_per_request, 1
    batch = len(qo_indptr) - 1
    if x >= offsets[batch]:
        return False, 0, 0, 0, 0
    lo, hi = 0, batch - 1  # largest b with offsets[b] <= x (the kernel's binary search)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if offsets[mid] <= x:
            lo = mid
        else:
            hi = mid - 1
    ntiles = offsets[lo + 1] - offsets[lo]
    q_start = int(qo_indptr[lo])
    return True, lo, int(ntiles - 1 - (x - offsets[lo])), q_start, int(qo_indptr[lo + 1]) - q_start


# -- the K/V loader (paged_attention_kernel: owned_tok / fetch_idx / make_bases / copy_kv) ------------

BLOCK_N = 64


def emulate_loader(warps, d, page_size, num_kv_heads, kvh, kv_indices, kv_beg, num_pages, tok0, s_end):
    """One tile's cp.async copies as the kernel issues them: {(row, chunk): src element offset or None (0 bytes)}
    and the bad-page flag. Lanes own warp-rows, resolve their pages, the copy loop reads offsets by shuffle."""
    ch = d // 8
    rpw, rpi = 32 // ch, warps * 32 // ch
    iters, rw = BLOCK_N // rpi, BLOCK_N // warps
    slots = -(-rw // 32)
    shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
    row_stride = num_kv_heads * d
    copies, bad_page = {}, False
    for w in range(warps):
        base = np.full((32, slots), -1, dtype=np.int64)  # per lane: the registers base[SLOTS]
        for lane in range(32):
            for s in range(slots):
                k = s * 32 + lane
                tok = tok0 + (k // rpw) * rpi + w * rpw + k % rpw
                inside = (rw % 32 == 0 or k < rw) and tok < s_end
                pi = tok >> shift if shift >= 0 else tok // page_size
                pidx = int(kv_indices[kv_beg + (pi if inside else 0)])  # fetch_idx (a tile ahead)
                ok = inside and 0 <= pidx < num_pages  # make_bases: the unsigned compare
                bad_page |= inside and not ok
                elem = (pidx * page_size + (tok - pi * page_size)) * row_stride + kvh * d
                base[lane, s] = elem * 2 + 1 if ok else 0  # bytes (16-bit elements) | copy bit
        for it in range(iters):  # copy_kv
            for lane in range(32):
                c, sub = lane % ch, lane // ch
                b = int(base[(it * rpw) % 32 + sub, (it * rpw) // 32])  # __shfl_sync from the owner lane
                src_bytes, byte_off = (b & 1) << 4, (b & ~1) + c * 16  # from kg + c * 8 elements
                assert byte_off % 16 == 0 and byte_off >= 0
                r = it * rpi + w * rpw + sub
                assert (r, c) not in copies, f"row {r} chunk {c} copied twice"
                copies[(r, c)] = byte_off // 2 if src_bytes == 16 else None
    return copies, bad_page


# -- ldmatrix / mma.sync m16n8k16 per lane (PTX ISA fragment layouts) --------------------------------------

LANES = np.arange(32)
G, C = LANES >> 2, LANES & 3  # mma fragment row (groupID) and column pair (thread in group)


def ldmatrix_x4(smem, addr):
    """smem: flat array; addr[lane]: element offset of the row lane supplies (lanes 8i..8i+7: matrix i).
    Returns regs[lane, i, 2]: lane t holds row t // 4, columns 2 (t % 4) + {0, 1} of matrix i."""
    regs = np.empty((32, 4, 2))
    for i in range(4):
        rows = addr[8 * i + G]
        regs[:, i, 0] = smem[rows + 2 * C]
        regs[:, i, 1] = smem[rows + 2 * C + 1]
    return regs


def ldmatrix_x4_trans(smem, addr):
    """.trans: lane t holds element (row 2 (t % 4) + e, column t // 4) of matrix i, i.e. of the transpose."""
    regs = np.empty((32, 4, 2))
    for i in range(4):
        for e in range(2):
            regs[:, i, e] = smem[addr[8 * i + 2 * C + e] + G]
    return regs


def mma_16816(d, a, b0, b1):
    """d[lane, 4] += A (16x16, a[lane, 4, 2]) @ B (16x8, b0/b1[lane, 2]); the row.col fragment layouts."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for e in range(2):
        A[G, 2 * C + e], A[G + 8, 2 * C + e] = a[:, 0, e], a[:, 1, e]
        A[G, 2 * C + 8 + e], A[G + 8, 2 * C + 8 + e] = a[:, 2, e], a[:, 3, e]
        B[2 * C + e, G], B[2 * C + 8 + e, G] = b0[:, e], b1[:, e]
    Dm = A @ B
    for e in range(2):
        d[:, e] += Dm[G, 2 * C + e]
        d[:, 2 + e] += Dm[G + 8, 2 * C + e]


def quad_reduce(x, op):
    """__shfl_xor_sync over lanes ^1 then ^2: the four lanes of a row group."""
    x = op(x, x[LANES ^ 1])
    return op(x, x[LANES ^ 2])


# -- a prefill case ---------------------------------------------------------------------------------------


def prefill_case(d, hq, hkv, page_size, qo_lens, kv_lens, causal, seed, empty=()):
    """A random float64 prefill case (requests in `empty` lose their pages) and the reference's answer:
    (q, qo_indptr, kv, scale, ref_out, ref_lse): the input of the prefill and wgmma emulations."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(kv_lens, page_size, hkv, d, torch.float64, "cpu", gen=gen)
    if empty:
        kv = without_pages(kv, set(empty))
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    q = torch.randn((int(qo_indptr[-1]), hq, d), generator=gen, dtype=torch.float64)
    scale = d**-0.5
    ref_out, ref_lse = torch.full_like(q, np.nan), torch.full(q.shape[:2], np.nan, dtype=torch.float64)
    reference.paged_prefill_attention(q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, causal, scale, ref_out, ref_lse)
    return q, qo_indptr, kv, scale, ref_out.numpy(), ref_lse.numpy()
