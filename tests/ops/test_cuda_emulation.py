"""Python emulation of the CUDA attention kernel's block-level index math (runs without a GPU).

Mirrors csrc/cuda/attention_kernel.cu line by line: the tile map (tile_map_kernel), which request
and row tile a CTA column takes (locate_tile), and the rows the attention epilogue and the split
merge write. Checked: every row of a valid query range is written exactly once by each, and no row
outside the valid ranges is ever written (the merge runs over the same tiles, not over all rows).
"""

from __future__ import annotations

import numpy as np
import pytest


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


def written_rows(qo_indptr, num_qo, num_heads, group, rows_tile, num_kv_heads):
    """Rows (token * num_heads + head) written per launch, as counts: the grid is the host's upper bound."""
    ragged = qo_indptr is not None
    if ragged:
        batch = len(qo_indptr) - 1
        offsets = tile_map(qo_indptr, num_qo, group, rows_tile)
        grid_x, tpr = -(-num_qo * group // rows_tile) + batch, 0
    else:
        offsets, tpr = None, -(-group // rows_tile)
        grid_x = num_qo * tpr
    counts = np.zeros(num_qo * num_heads, dtype=np.int64)
    for kvh in range(num_kv_heads):
        for x in range(grid_x):
            ok, b, tile, q_start, qo_len = locate_tile(x, qo_indptr, offsets, tpr)
            if not ok:
                continue
            row_beg = tile * rows_tile
            rows_valid = min(rows_tile, qo_len * group - row_beg)
            for pr in range(row_beg, row_beg + rows_valid):  # the epilogue's and the merge's rows
                counts[(q_start + pr // group) * num_heads + kvh * group + pr % group] += 1
    return counts


def expected_counts(qo_indptr, num_qo, num_heads):
    """How many valid query ranges hold each row (ranges of a bad qo_indptr may overlap)."""
    counts = np.zeros(num_qo * num_heads, dtype=np.int64)
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if 0 <= q0 <= q1 <= num_qo:
            counts[q0 * num_heads:q1 * num_heads] += 1
    return counts


@pytest.mark.parametrize("hq,hkv,warps", [(32, 8, 4), (8, 8, 4), (24, 3, 4), (96, 1, 4)])
def test_ragged_tiles_cover_valid_rows_once(hq, hkv, warps):
    rng = np.random.default_rng(hq)
    group, rows_tile = hq // hkv, 16 * warps
    qo_lens = rng.integers(0, 90, size=9)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    num_qo = int(qo_indptr[-1])
    counts = written_rows(qo_indptr, num_qo, hq, group, rows_tile, hkv)
    assert (counts == 1).all()
    # invalid ranges (past num_qo, decreasing) get no tiles: their rows are never written, the others still are
    bad = qo_indptr.copy()
    bad[4] = num_qo + 5
    want = expected_counts(bad, num_qo, hq)
    assert (want == 0).any()
    assert (written_rows(bad, num_qo, hq, group, rows_tile, hkv) == want).all()


@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8), (96, 1), (128, 1)])
def test_decode_tiles_cover_every_row_once(hq, hkv):
    group = hq // hkv
    warps = min(4, -(-group // 16))
    counts = written_rows(None, 7, hq, group, 16 * warps, hkv)
    assert (counts == 1).all()
