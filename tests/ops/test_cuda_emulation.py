"""Python emulation of the CUDA attention kernel's block-level index math (runs without a GPU).

Mirrors csrc/cuda/attention_kernel.cu line by line: the tile map (tile_map_kernel), which request
and row tile a CTA column takes (locate_tile), and the rows the attention epilogue and the split
merge write. Checked: every row of a valid query range is written exactly once by each, and no row
outside the valid ranges is ever written (the merge runs over the same tiles, not over all rows).
And the K/V loader's copies against the page table. tile_map, locate_tile and the loader live in
tests/helpers/cuda_emulation.py (the CTA emulations use them too).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.cuda_emulation import BLOCK_N, emulate_loader, locate_tile, tile_map


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
            counts[q0 * num_heads : q1 * num_heads] += 1
    return counts


@pytest.mark.parametrize("rows_tile", [64, 128], ids=["16-rows-per-warp", "32-rows-per-warp"])  # 4 x 1 x RF
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8), (24, 3), (96, 1)])
def test_ragged_tiles_cover_valid_rows_once(hq, hkv, rows_tile):
    rng = np.random.default_rng(hq)
    group = hq // hkv
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


# -- the K/V loader (paged_attention_kernel: owned_tok / fetch_idx / make_bases / copy_kv) ------------


def reference_copies(d, page_size, num_kv_heads, kvh, kv_indices, kv_beg, num_pages, tok0, s_end):
    """What the tile must hold: row r = token tok0 + r at page kv_indices[kv_beg + tok // page_size]."""
    want, bad = {}, False
    for r in range(BLOCK_N):
        tok = tok0 + r
        page = int(kv_indices[kv_beg + tok // page_size]) if tok < s_end else None
        if page is not None and not 0 <= page < num_pages:
            bad, page = True, None
        for c in range(d // 8):
            slot = page * page_size + tok % page_size if page is not None else None
            want[(r, c)] = None if slot is None else (slot * num_kv_heads + kvh) * d + c * 8
    return want, bad


@pytest.mark.parametrize("warps", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_loader_matches_page_table(warps, d, page_size):
    rng = np.random.default_rng(warps * 1000 + d + page_size)
    num_pages, hkv = 4000, 3
    for trial in range(6):
        kv_len = int(rng.integers(1, 700))
        kv_beg = int(rng.integers(0, 50))
        npages = -(-kv_len // page_size)
        kv_indices = rng.integers(0, num_pages, size=kv_beg + npages + 2).astype(np.int64)
        if trial == 5:  # a bad page (out of range or negative) must flag the request and never be read
            kv_indices[kv_beg + npages // 2] = num_pages + 7 if page_size > 1 else -3
        s_beg = int(rng.integers(0, max(1, kv_len // BLOCK_N))) * BLOCK_N
        s_end = min(kv_len, s_beg + int(rng.integers(1, 300)))
        kvh = int(rng.integers(0, hkv))
        for tok0 in range(s_beg, s_end, BLOCK_N):
            got, got_bad = emulate_loader(warps, d, page_size, hkv, kvh, kv_indices, kv_beg, num_pages, tok0, s_end)
            want, want_bad = reference_copies(d, page_size, hkv, kvh, kv_indices, kv_beg, num_pages, tok0, s_end)
            assert got == want
            assert got_bad == want_bad
