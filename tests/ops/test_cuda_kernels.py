"""CUDA-only extra cases for the native kernels (skipped without a GPU): the target shapes scaled
down, split-KV paths, NaN poisoning of bad page tables, GQA ratios, ragged lengths, cascade."""

from __future__ import annotations

import pytest
import torch

from helpers.paged_kv import make_paged_kv, without_pages
from helpers.targets import poison, randn, to_ref
from minisched import ops
from minisched.ops import reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR)),
]
DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def ref_decode(q, kv, scale):
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    out, lse = torch.empty_like(q64), torch.empty(q64.shape[:2])
    reference.paged_decode_attention(q64, k64, v64, *to_ref(*kv.table), scale, out, lse)
    return out, lse


def ref_prefill(q, qo_indptr, kv, causal, scale):
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    out, lse = torch.empty_like(q64), torch.empty(q64.shape[:2])
    reference.paged_prefill_attention(q64, qo_indptr.cpu(), k64, v64, *to_ref(*kv.table), causal, scale, out, lse)
    return out, lse


def check(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output rows"
    torch.testing.assert_close(out.cpu().double(), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 4), (32, 4), (32, 1), (96, 1)])
def test_decode_long_context_split_kv(dtype, page_size, head_dim, hq, hkv, gen):
    """Few requests with long contexts: the split-KV + merge path (GQA <= 16: 1 x 4 warps, 32/1: 2 x 2,
    and g > 64 rows for 96/1: 4 x 1)."""
    lens = [2048, 1, 777, 1500]
    kv = make_paged_kv(lens, page_size, hkv, head_dim, dtype, "cuda", gen=gen)
    q = randn((len(lens), hq, head_dim), dtype, "cuda", gen)
    out, lse = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, *kv.table, return_lse=True)
    check(out, lse, *ref_decode(q, kv, head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(32, 8), (24, 1)], ids=["1x4-warps", "2x2-warps"])
def test_decode_kv_warps_partial_tiles(dtype, hq, hkv, gen):
    """Split-K inside the decode CTA: lengths that leave KV warps with no key (1, 5, 16), one key (17, 33,
    49, 65) or a partial last tile, merged through shared memory; and an empty range (no pages)."""
    lens = [1, 5, 16, 17, 33, 49, 63, 64, 65, 130, 7]
    kv = without_pages(make_paged_kv(lens, 16, hkv, 128, dtype, "cuda", gen=gen), {len(lens) - 1})
    q = randn((len(lens), hq, 128), dtype, "cuda", gen)
    out, lse = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, *kv.table, return_lse=True)
    check(out, lse, *ref_decode(q, kv, 128**-0.5), dtype)
    assert (out[-1] == 0).all() and (lse[-1] == float("-inf")).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_target_shape_scaled(dtype, gen):
    """B 16, ctx ~1024, 32/8 heads, d128 (the benchmark shape, smaller)."""
    lens = [1024 - 7 * i for i in range(16)]
    kv = make_paged_kv(lens, 16, 8, 128, dtype, "cuda", gen=gen)
    q = randn((16, 32, 128), dtype, "cuda", gen)
    out, lse = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, *kv.table, return_lse=True)
    check(out, lse, *ref_decode(q, kv, 128**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size,head_dim,hq,hkv", [(16, 128, 32, 8), (1, 64, 4, 4), (16, 64, 24, 3)])
def test_prefill_ragged(dtype, causal, page_size, head_dim, hq, hkv, gen):
    """Ragged prefill with cached prefixes: qo_len <= kv_len, an empty request, a 1-token request."""
    kv_lens = [300, 17, 64, 5, 129]
    qo_lens = [300, 9, 0, 1, 70]
    kv = make_paged_kv(kv_lens, page_size, hkv, head_dim, dtype, "cuda", gen=gen)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = randn((sum(qo_lens), hq, head_dim), dtype, "cuda", gen)
    out, lse = ops.paged_prefill_attention(
        q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, causal=causal, return_lse=True
    )
    check(out, lse, *ref_prefill(q, qo_indptr, kv, causal, head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size,head_dim,hq,hkv", [(1, 128, 4, 4), (3, 64, 6, 2), (16, 128, 32, 4), (16, 64, 8, 1)])
def test_prefill_128_row_tiles(dtype, causal, page_size, head_dim, hq, hkv, gen):
    """The 4 x 1 x 2 prefill CTA (32 rows per warp: two m16 fragments, 128-row tiles): requests whose rows end
    inside a warp's first or second fragment, at a 128-row tile, one row past it, several tiles; qo_len 1;
    prefixes across page and 64-token tile boundaries; every row written (the outputs are NaN-poisoned). The mean
    request has > 64 rows (92 tokens), so the launcher takes the 128-row CTA."""
    qo_lens = [1, 5, 33, 64, 129, 200, 3, 300]
    prefix = [0, 16, 17, 63, 64, 1, 130, 700]
    kv = make_paged_kv([a + b for a, b in zip(qo_lens, prefix)], page_size, hkv, head_dim, dtype, "cuda", gen=gen)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = randn((sum(qo_lens), hq, head_dim), dtype, "cuda", gen)
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(q.shape[:2], device="cuda"))
    ops.call_op(
        "paged_prefill_attention",
        (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, causal, head_dim**-0.5, out, lse),
        "native",
    )
    check(out, lse, *ref_prefill(q, qo_indptr, kv, causal, head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 32, 4), (64, 3, 1)])
def test_prefill_128_row_tiles_split_kv_and_empty_range(dtype, head_dim, hq, hkv, gen):
    """Few query rows on long prefixes (split-KV + merge over the 128-row tile map), next to a request with no
    pages (non-causal: out 0, lse -inf); 100 rows per request on average (128-row CTA)."""
    kv_lens = [3000, 2500, 20]
    kv = without_pages(make_paged_kv(kv_lens, 16, hkv, head_dim, dtype, "cuda", gen=gen), {2})
    qo_indptr = torch.tensor([0, 7, 97, 100], dtype=torch.int32, device="cuda")
    q = randn((100, hq, head_dim), dtype, "cuda", gen)
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(q.shape[:2], device="cuda"))
    ops.call_op(
        "paged_prefill_attention",
        (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, False, head_dim**-0.5, out, lse),
        "native",
    )
    check(out, lse, *ref_prefill(q, qo_indptr, kv, False, head_dim**-0.5), dtype)
    assert bool((out[97:] == 0).all()) and bool((lse[97:] == float("-inf")).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_short_extends_64_row_tiles(dtype, causal, gen):
    """Short extends on long prefixes (mean <= 64 rows per request: the launcher keeps the 64-row 4 x 1 x 1 CTA),
    with one longer request whose rows span two 64-row tiles."""
    qo_lens = [1, 2, 4, 3, 1, 20, 2, 1]
    kv = make_paged_kv([900 + 37 * i for i in range(8)], 16, 8, 128, dtype, "cuda", gen=gen)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = randn((sum(qo_lens), 32, 128), dtype, "cuda", gen)
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(q.shape[:2], device="cuda"))
    ops.call_op(
        "paged_prefill_attention", (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, causal, 0.09, out, lse), "native"
    )
    check(out, lse, *ref_prefill(q, qo_indptr, kv, causal, 0.09), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_bad_page_table_poisons_only_its_request(dtype, gen):
    """128-row tiles: a bad page index and (causal) qo_len > kv_len give NaN rows for that request only."""
    kv = make_paged_kv([50, 90, 10, 30], 16, 2, 128, dtype, "cuda", gen=gen)
    bad = kv.kv_indices.clone()
    bad[int(kv.kv_indptr[1]) + 2] = kv.k_cache.shape[0] + 5  # request 1: a page past the pool
    qo_indptr = torch.tensor([0, 20, 60, 72, 79], dtype=torch.int32, device="cuda")  # request 2: 12 queries, 10 keys
    q = randn((79, 8, 128), dtype, "cuda", gen)
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(79, 8, device="cuda"))
    ops.call_op(
        "paged_prefill_attention",
        (q, qo_indptr, kv.k_cache, kv.v_cache, kv.kv_indptr, bad, kv.kv_last_page_len, True, 0.1, out, lse),
        "native",
        check=False,
    )
    assert torch.isnan(out[20:72]).all() and torch.isnan(lse[20:72]).all()
    good = torch.cat([torch.arange(0, 20), torch.arange(72, 79)])
    sel = torch.tensor([0, 20, 20, 20, 27], dtype=torch.int32)  # requests 1, 2 without queries
    ro, rl = ref_prefill(q[good.cuda()], sel, kv, True, 0.1)
    check(out[good.cuda()], lse[good.cuda()], ro, rl, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_target_shape_scaled(dtype, gen):
    """2 x 512 causal, 32/8 heads, d128 (the benchmark shape, smaller)."""
    kv = make_paged_kv([512, 512], 16, 8, 128, dtype, "cuda", gen=gen)
    qo_indptr = torch.tensor([0, 512, 1024], dtype=torch.int32, device="cuda")
    q = randn((1024, 32, 128), dtype, "cuda", gen)
    out, lse = ops.paged_prefill_attention(q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, return_lse=True)
    check(out, lse, *ref_prefill(q, qo_indptr, kv, True, 128**-0.5), dtype)


# -- the Hopper wgmma prefill kernel (attention_wgmma.cu; cuda_kernel="wgmma", schema kernel=2) ----------------
IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not IS_SM90, reason="the wgmma kernel is built for sm_90a (Hopper) only")
WGMMA = 2


def run_wgmma(q, qo_indptr, kv, causal, scale, table=None, check_values=True):
    """The wgmma kernel into NaN-poisoned outputs (every valid row must be written)."""
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(q.shape[:2], device=q.device))
    ops.call_op(
        "paged_prefill_attention",
        (q, qo_indptr, kv.k_cache, kv.v_cache, *(table or kv.table), causal, scale, out, lse, WGMMA),
        "native",
        check=check_values,
    )
    return out, lse


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 4), (32, 4)], ids=["gqa1", "gqa4", "gqa8"])
def test_wgmma_prefill_matches_reference(dtype, causal, page_size, head_dim, hq, hkv, gen):
    """Ragged requests whose rows end inside either warpgroup (64-row halves), at a 128-row tile and one row past
    it, several tiles; qo_len 1; prefixes across page and 64-token tile boundaries (63, 64, 65 keys)."""
    qo_lens = [1, 5, 33, 64, 65, 129, 200, 3, 300]
    prefix = [0, 16, 17, 0, 63, 64, 1, 130, 700]
    kv = make_paged_kv([a + b for a, b in zip(qo_lens, prefix)], page_size, hkv, head_dim, dtype, "cuda", gen=gen)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    q = randn((sum(qo_lens), hq, head_dim), dtype, "cuda", gen)
    out, lse = run_wgmma(q, qo_indptr, kv, causal, head_dim**-0.5)
    check(out, lse, *ref_prefill(q, qo_indptr, kv, causal, head_dim**-0.5), dtype)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_prefill_empty_range_and_long_prefix(dtype, head_dim, gen):
    """A request with no pages (non-causal: out 0, lse -inf) between long-prefix requests (one KV split: the
    wgmma kernel walks the whole range)."""
    kv = without_pages(make_paged_kv([3000, 20, 2500], 16, 4, head_dim, dtype, "cuda", gen=gen), {1})
    qo_indptr = torch.tensor([0, 7, 10, 100], dtype=torch.int32, device="cuda")
    q = randn((100, 16, head_dim), dtype, "cuda", gen)
    out, lse = run_wgmma(q, qo_indptr, kv, False, head_dim**-0.5)
    check(out, lse, *ref_prefill(q, qo_indptr, kv, False, head_dim**-0.5), dtype)
    assert bool((out[7:10] == 0).all()) and bool((lse[7:10] == float("-inf")).all())


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgmma_prefill_bad_page_table_poisons_only_its_request(dtype, gen):
    kv = make_paged_kv([50, 90, 10, 30], 16, 2, 128, dtype, "cuda", gen=gen)
    bad = kv.kv_indices.clone()
    bad[int(kv.kv_indptr[1]) + 2] = kv.k_cache.shape[0] + 5  # request 1: a page past the pool
    qo_indptr = torch.tensor([0, 20, 60, 72, 79], dtype=torch.int32, device="cuda")  # request 2: 12 queries, 10 keys
    q = randn((79, 8, 128), dtype, "cuda", gen)
    out, lse = run_wgmma(
        q, qo_indptr, kv, True, 0.1, table=(kv.kv_indptr, bad, kv.kv_last_page_len), check_values=False
    )
    assert torch.isnan(out[20:72]).all() and torch.isnan(lse[20:72]).all()
    good = torch.cat([torch.arange(0, 20), torch.arange(72, 79)])
    sel = torch.tensor([0, 20, 20, 20, 27], dtype=torch.int32)
    ro, rl = ref_prefill(q[good.cuda()], sel, kv, True, 0.1)
    check(out[good.cuda()], lse[good.cuda()], ro, rl, dtype)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgmma_prefill_target_shape_scaled_equals_mma(dtype, gen):
    """2 x 512 causal, 32/8 heads, d128 through the wrapper's cuda_kernel="wgmma": the reference, and the mma.sync
    kernel within the 16-bit tolerance."""
    kv = make_paged_kv([512, 512], 16, 8, 128, dtype, "cuda", gen=gen)
    qo_indptr = torch.tensor([0, 512, 1024], dtype=torch.int32, device="cuda")
    q = randn((1024, 32, 128), dtype, "cuda", gen)
    out, lse = ops.paged_prefill_attention(
        q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, return_lse=True, cuda_kernel="wgmma"
    )
    check(out, lse, *ref_prefill(q, qo_indptr, kv, True, 128**-0.5), dtype)
    out_mma = ops.paged_prefill_attention(q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, cuda_kernel="mma")
    torch.testing.assert_close(out, out_mma, **TOL[dtype])


def test_cuda_kernel_errors_on_device(gen):
    """An unknown cuda_kernel is a ValueError; "wgmma" off sm_90 or with head_dim 96 too (checked in Python and,
    for the schema argument, in the CUDA wrapper)."""
    kv = make_paged_kv([8], 16, 2, 64, torch.float16, "cuda", gen=gen)
    qo_indptr = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    q = randn((8, 2, 64), torch.float16, "cuda", gen)
    with pytest.raises(ValueError, match="cuda_kernel"):
        ops.paged_prefill_attention(q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, cuda_kernel="fa3")
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="kernel"):
        ops.call_op(
            "paged_prefill_attention",
            (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, True, 0.1, out, None, 7),
            "native",
        )
    if not IS_SM90:
        with pytest.raises(ValueError, match="sm_90"):
            ops.paged_prefill_attention(q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, cuda_kernel="wgmma")
        with pytest.raises(ValueError, match="sm_90"):
            ops.call_op(
                "paged_prefill_attention",
                (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, True, 0.1, out, None, WGMMA),
                "native",
            )
    kv96 = make_paged_kv([8], 16, 2, 96, torch.float16, "cuda", gen=gen)
    q96 = randn((8, 2, 96), torch.float16, "cuda", gen)
    with pytest.raises(ValueError, match="wgmma"):
        ops.paged_prefill_attention(q96, qo_indptr, kv96.k_cache, kv96.v_cache, *kv96.table, cuda_kernel="wgmma")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_equals_full_decode(dtype, page_size, gen):
    """shared prefix + own suffix, merged == plain paged decode over the whole sequence."""
    hq, hkv, d, prefix, n = 16, 4, 128, 320, 12  # the prefix is page aligned (shared pages)
    suffix = [1 + 13 * i for i in range(n)]
    kv = make_paged_kv([prefix] + suffix, page_size, hkv, d, dtype, "cuda", gen=gen)
    pre_pages = kv.kv_indices[kv.kv_indptr[0] : kv.kv_indptr[1]]
    full_idx, full_ptr, full_last, suf_idx, suf_ptr = [], [0], [], [], [0]
    for i in range(n):
        own = kv.kv_indices[kv.kv_indptr[i + 1] : kv.kv_indptr[i + 2]]
        full_idx.append(torch.cat([pre_pages, own]))
        full_ptr.append(full_ptr[-1] + len(pre_pages) + len(own))
        suf_idx.append(own)
        suf_ptr.append(suf_ptr[-1] + len(own))
        full_last.append(int(kv.kv_last_page_len[i + 1]))
    i32 = dict(dtype=torch.int32, device="cuda")
    full = (torch.tensor(full_ptr, **i32), torch.cat(full_idx), torch.tensor(full_last, **i32))
    suf = (torch.tensor(suf_ptr, **i32), torch.cat(suf_idx), torch.tensor(full_last, **i32))
    pre = (kv.kv_indptr[:2].clone(), pre_pages.clone(), kv.kv_last_page_len[:1].clone())
    q = randn((n, hq, d), dtype, "cuda", gen)
    group = torch.tensor([0, n], **i32)
    out = ops.cascade_decode_attention(q, group, kv.k_cache, kv.v_cache, pre, suf)
    plain = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, *full)
    torch.testing.assert_close(out.float(), plain.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_prefix_many_rows_short_prefix(dtype, gen):
    """More query rows than prefix tokens (non-causal: allowed), split over groups."""
    kv = make_paged_kv([5, 40], 16, 2, 64, dtype, "cuda", gen=gen)
    group = torch.tensor([0, 30, 33], dtype=torch.int32, device="cuda")
    q = randn((33, 8, 64), dtype, "cuda", gen)
    out, lse = ops.shared_prefix_attention(q, group, kv.k_cache, kv.v_cache, *kv.table)
    check(out, lse, *ref_prefill(q, group, kv, False, 64**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_page_index_poisons_only_its_request(dtype, gen):
    """CUDA page tables are not value-checked (a sync): a bad page gives NaN rows, nothing else."""
    kv = make_paged_kv([40, 40], 16, 2, 64, dtype, "cuda", gen=gen)
    q = randn((2, 4, 64), dtype, "cuda", gen)
    ref_out, _ = ref_decode(q, kv, 0.125)
    bad = kv.kv_indices.clone()
    bad[1] = kv.k_cache.shape[0] + 100  # request 0's second page
    out, lse = ops.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.kv_indptr, bad, kv.kv_last_page_len, sm_scale=0.125, return_lse=True, check=False
    )
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    torch.testing.assert_close(out[1].cpu().double(), ref_out[1], **TOL[dtype])
    bad_last = kv.kv_last_page_len.clone()
    bad_last[1] = 99
    out = ops.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.kv_indptr, kv.kv_indices, bad_last, sm_scale=0.125, check=False
    )
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[4000, 3000], [40, 30]], ids=["split-kv", "one-split"])
def test_empty_kv_range_gives_zero_and_neg_inf(dtype, lens, gen):
    """A request with no pages (an empty suffix in cascade decode) gives out 0, lse -inf, not NaN,
    through the direct epilogue and through the split merge (every split empty)."""
    kv = make_paged_kv(lens, 16, 2, 128, dtype, "cuda", gen=gen)
    i32 = dict(dtype=torch.int32, device="cuda")
    n0 = int(kv.kv_indptr[1])
    indptr = torch.tensor([0, 0, n0, n0], **i32)  # requests 0 and 2 empty, request 1 = the old request 0
    last = torch.tensor([1, int(kv.kv_last_page_len[0]), 16], **i32)
    indices = kv.kv_indices[:n0].contiguous()
    q = randn((3, 16, 128), dtype, "cuda", gen)
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(3, 16, device="cuda"))
    ops.call_op("paged_decode_attention", (q, kv.k_cache, kv.v_cache, indptr, indices, last, 0.1, out, lse), "native")
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    ro, rl = torch.empty_like(q64), torch.empty(3, 16)
    reference.paged_decode_attention(q64, k64, v64, *to_ref(indptr, indices, last), 0.1, ro, rl)
    assert bool((out[[0, 2]] == 0).all()) and bool((lse[[0, 2]] == float("-inf")).all())
    check(out, lse, ro, rl, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_merge_writes_only_computed_rows(dtype, gen):
    """Split-KV prefill (few rows, long KV) with an invalid qo range (check=False: CUDA does not read index
    values on the host): the rows no tile computed stay as they were; the valid request is right."""
    kv = make_paged_kv([3000, 3000], 16, 2, 64, dtype, "cuda", gen=gen)
    q = randn((8, 4, 64), dtype, "cuda", gen)
    qo_indptr = torch.tensor([0, 4, 2], dtype=torch.int32, device="cuda")  # request 1: qo range 4..2, invalid
    out, lse = poison(torch.empty_like(q)), poison(torch.empty(8, 4, device="cuda"))
    ops.call_op(
        "paged_prefill_attention",
        (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, False, 0.125, out, lse),
        "native",
        check=False,
    )
    assert torch.isnan(out[4:]).all() and torch.isnan(lse[4:]).all(), "rows of no tile were written"
    ref_qo = torch.tensor([0, 4], dtype=torch.int32)
    ro, rl = ref_prefill(q[:4], ref_qo, kv, False, 0.125)  # only request 0 (same KV table prefix)
    check(out[:4], lse[:4], ro, rl, dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
def test_merge_states_edge_lse(dtype, gen):
    n, h, d = 5, 3, 64
    va, vb = randn((n, h, d), dtype, "cuda", gen), randn((n, h, d), dtype, "cuda", gen)
    la, lb = randn((n, h), torch.float32, "cuda", gen), randn((n, h), torch.float32, "cuda", gen)
    la[0], lb[1], la[2], lb[2] = float("-inf"), float("-inf"), float("-inf"), float("-inf")
    out, lse = ops.merge_attention_states(va, la, vb, lb)
    ro, rl = torch.empty(n, h, d, dtype=torch.float64), torch.empty(n, h)
    reference.merge_attention_states(*to_ref(va, la, vb, lb), ro, rl)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), ro, **tol)
    torch.testing.assert_close(lse.cpu(), rl, atol=1e-5, rtol=1e-5)


def test_attention_rejects_float32(gen):
    kv = make_paged_kv([5], 16, 2, 64, torch.float32, "cuda", gen=gen)
    q = torch.randn(1, 4, 64, device="cuda")
    with pytest.raises(TypeError, match="dtype"):
        ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, *kv.table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_strided_and_skips(dtype, gen):
    """k/v as slices of a fused QKV tensor; slot -1 and an out-of-range slot are skipped."""
    n, hkv, d, pages, ps = 7, 2, 64, 4, 16
    qkv = randn((n, 6, d), dtype, "cuda", gen)
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    kc, vc = (torch.zeros(pages, ps, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    slots = torch.tensor([0, 5, -1, 17, 63, 2, 10_000], dtype=torch.int32, device="cuda")
    ops.store_kv(k, v, kc, vc, slots, check=False)
    rk, rv = kc.cpu().clone().zero_(), vc.cpu().clone().zero_()
    ref_slots = slots.cpu().clone()
    ref_slots[ref_slots >= pages * ps] = -1  # CUDA skips out-of-range slots (no host check: a sync)
    reference.store_kv(k.cpu(), v.cpu(), rk, rv, ref_slots)
    assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size,hkv,d", [(1, 1, 64), (16, 8, 128), (3, 3, 64)])
def test_copy_gather_scatter_pinned(dtype, page_size, hkv, d, gen):
    kv = randn((3, 2, 20, page_size, hkv, d), dtype, "cuda", gen)
    pages = torch.randperm(16, generator=gen)[:7].to(torch.int32)  # copies below go to pages 17..19
    host = poison(torch.empty((3, 2, 7, page_size, hkv, d), dtype=dtype, pin_memory=True))
    ops.gather_kv_pages(kv, pages.cuda(), host)
    torch.cuda.synchronize()
    assert torch.equal(host, kv.cpu()[:, :, pages.long()])
    pageable = poison(torch.empty_like(host, pin_memory=False))
    ops.gather_kv_pages(kv, pages.cuda(), pageable)
    assert torch.equal(pageable, host)
    fresh = torch.zeros_like(kv)
    ops.scatter_kv_pages(pageable, fresh, pages.cuda())
    assert torch.equal(fresh.cpu()[:, :, pages.long()], host)
    src, dst = pages[:3], torch.tensor([19, 18, 17], dtype=torch.int32)
    before = kv.cpu().clone()
    reference.copy_kv_pages(before, src, dst)
    ops.copy_kv_pages(kv, src.cuda(), dst.cuda())
    assert torch.equal(kv.cpu(), before)
