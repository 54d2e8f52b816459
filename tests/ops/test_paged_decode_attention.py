"""paged_decode_attention: every backend against the float64 reference on fresh random paged KV."""

import pytest
import torch

from helpers.paged_kv import ATTN_SHAPES, make_paged_kv, ragged_lens, without_pages
from helpers.targets import poison, randn, targets, to_ref
from minisched import ops
from minisched.ops import reference

TARGETS = targets("paged_decode_attention")


def run_decode(t, q, kv, scale, with_lse=True):
    out = poison(torch.empty_like(q))
    lse = poison(q.new_empty(q.shape[:2], dtype=torch.float32)) if with_lse else None
    ops.call_op("paged_decode_attention", (q, kv.k_cache, kv.v_cache, *kv.table, scale, out, lse), t.backend)
    return out, lse


def expected(q, kv, scale):
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    out = torch.empty_like(q64)
    lse = torch.empty(q64.shape[:2], dtype=torch.float32)
    reference.paged_decode_attention(q64, k64, v64, *to_ref(*kv.table), scale, out, lse)
    return out, lse


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size,head_dim,hq,hkv", ATTN_SHAPES)
def test_matches_reference(t, page_size, head_dim, hq, hkv, gen):
    lens = ragged_lens(page_size, long=96 if t.interpreted else 300)
    kv = make_paged_kv(lens, page_size, hkv, head_dim, t.dtype, t.device, gen=gen)
    q = randn((len(lens), hq, head_dim), t.dtype, t.device, gen)
    scale = head_dim**-0.5
    out, lse = run_decode(t, q, kv, scale)
    ref_out, ref_lse = expected(q, kv, scale)
    torch.testing.assert_close(out.cpu().double(), ref_out, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("long", [40, 300], ids=["one-split", "split-kv"])
@pytest.mark.parametrize("page_size,hq,hkv", [(16, 8, 2), (1, 4, 4)])
def test_empty_kv_range(t, long, page_size, hq, hkv, gen):
    """A request with no pages gives out 0 and lse -inf on every backend (and its neighbours are right),
    whether the kernel writes the output directly or merges split-KV partials (all empty)."""
    kv = without_pages(make_paged_kv([5, 3, long, 7], page_size, hkv, 64, t.dtype, t.device, gen=gen), {1, 3})
    q = randn((4, hq, 64), t.dtype, t.device, gen)
    out, lse = run_decode(t, q, kv, 0.125)
    ref_out, ref_lse = expected(q, kv, 0.125)
    assert bool((ref_out[[1, 3]] == 0).all()) and bool((ref_lse[[1, 3]] == float("-inf")).all())
    torch.testing.assert_close(out.cpu().double(), ref_out, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("t", TARGETS)
def test_without_lse_and_custom_scale(t, gen):
    kv = make_paged_kv([5, 33], 16, 2, 64, t.dtype, t.device, gen=gen)
    q = randn((2, 4, 64), t.dtype, t.device, gen)
    out, _ = run_decode(t, q, kv, 0.3, with_lse=False)
    torch.testing.assert_close(out.cpu().double(), expected(q, kv, 0.3)[0], **t.tol)


@pytest.mark.parametrize("t", TARGETS)
def test_empty_batch(t, gen):
    kv = make_paged_kv([3], 16, 2, 64, t.dtype, t.device, gen=gen)
    q = randn((0, 4, 64), t.dtype, t.device, gen)
    empty = torch.zeros(0, dtype=torch.int32, device=t.device)
    indptr = torch.zeros(1, dtype=torch.int32, device=t.device)
    out, lse = ops.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, indptr, empty, empty, return_lse=True, backend=t.backend
    )
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("t", TARGETS)
def test_wrapper_allocates_and_matches(t, gen):
    kv = make_paged_kv([17, 1, 40], 16, 3, 64, t.dtype, t.device, gen=gen)
    q = randn((3, 9, 64), t.dtype, t.device, gen)
    out = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, *kv.table, backend=t.backend)
    torch.testing.assert_close(out.cpu().double(), expected(q, kv, 64**-0.5)[0], **t.tol)
