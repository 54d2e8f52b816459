"""paged_prefill_attention: ragged queries over cached prefix + new tokens, causal bottom-right aligned."""

import pytest
import torch

from helpers.paged_kv import ATTN_SHAPES, make_paged_kv, without_pages
from helpers.targets import poison, randn, targets, to_ref
from minisched import ops
from minisched.ops import reference

TARGETS = targets("paged_prefill_attention")


def qo_indptr_of(qo_lens, device):
    ip = [0]
    for n in qo_lens:
        ip.append(ip[-1] + n)
    return torch.tensor(ip, dtype=torch.int32, device=device)


def run(t, q, qo_indptr, kv, causal, scale):
    out = poison(torch.empty_like(q))
    lse = poison(q.new_empty(q.shape[:2], dtype=torch.float32))
    ops.call_op(
        "paged_prefill_attention", (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, causal, scale, out, lse), t.backend
    )
    return out, lse


def expected(q, qo_indptr, kv, causal, scale):
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    out = torch.empty_like(q64)
    lse = torch.empty(q64.shape[:2], dtype=torch.float32)
    reference.paged_prefill_attention(q64, qo_indptr.cpu(), k64, v64, *to_ref(*kv.table), causal, scale, out, lse)
    return out, lse


def check(t, qo_lens, kv_lens, page_size, head_dim, hq, hkv, causal, gen):
    kv = make_paged_kv(kv_lens, page_size, hkv, head_dim, t.dtype, t.device, gen=gen)
    q = randn((sum(qo_lens), hq, head_dim), t.dtype, t.device, gen)
    qo_indptr = qo_indptr_of(qo_lens, t.device)
    scale = head_dim**-0.5
    out, lse = run(t, q, qo_indptr, kv, causal, scale)
    ref_out, ref_lse = expected(q, qo_indptr, kv, causal, scale)
    torch.testing.assert_close(out.cpu().double(), ref_out, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size,head_dim,hq,hkv", ATTN_SHAPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_reference(t, page_size, head_dim, hq, hkv, causal, gen):
    # request b: qo_len new tokens on top of (kv_len - qo_len) cached ones
    long = 80 if t.interpreted else 300
    kv_lens = [1, page_size, page_size + 1, long, page_size + 5]
    qo_lens = [1, page_size, 1, long // 3, page_size + 5]  # full prompt, partly cached, pure prefill
    check(t, qo_lens, kv_lens, page_size, head_dim, hq, hkv, causal, gen)


NATIVE_CPU = [p for p in TARGETS if p.values[0].backend == "native" and p.values[0].device == "cpu"]


@pytest.mark.parametrize("t", NATIVE_CPU)
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 1), (4, 4), (16, 2)])
@pytest.mark.parametrize("cached", [0, 5, 40])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_tiles_of_every_row_count(t, hq, hkv, cached, causal, gen):
    """The CPU kernel tiles a request's queries into up to 32 rows (tokens x the q heads of one kv head);
    on AVX-512 a tile of 16 rows or more runs in lane groups of 16 (csrc/cpu/attention_avx512.cpp,
    attn_block_lanes), fewer rows in the row-major products. Every tile size from 1 row to 32, whole and
    partial lane groups, rows whose causal limit falls inside a block and rows that see no key of it."""
    g = hq // hkv
    qo_lens = list(range(1, 32 // g + 2)) + [17, 33]
    check(t, qo_lens, [n + cached for n in qo_lens], 16, 64, hq, hkv, causal, gen)


@pytest.mark.parametrize("t", TARGETS)
def test_requests_with_no_new_tokens(t, gen):
    """qo_len 0 requests produce no rows and do not disturb their neighbours."""
    check(t, [0, 7, 0, 3], [4, 20, 9, 3], 16, 64, 4, 2, True, gen)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_empty_kv_range(t, causal, gen):
    """Requests with no KV pages (so no queries) beside normal ones: only the normal rows are written."""
    kv = without_pages(make_paged_kv([9, 4, 30, 2], 16, 2, 64, t.dtype, t.device, gen=gen), {1, 3})
    q = randn((12, 4, 64), t.dtype, t.device, gen)
    qo_indptr = qo_indptr_of([5, 0, 7, 0], t.device)
    out, lse = run(t, q, qo_indptr, kv, causal, 0.125)
    ref_out, ref_lse = expected(q, qo_indptr, kv, causal, 0.125)
    torch.testing.assert_close(out.cpu().double(), ref_out, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("t", TARGETS)
def test_empty_batch(t, gen):
    kv = make_paged_kv([3], 16, 2, 64, t.dtype, t.device, gen=gen)
    q = randn((0, 4, 64), t.dtype, t.device, gen)
    zero = torch.zeros(1, dtype=torch.int32, device=t.device)
    empty = torch.zeros(0, dtype=torch.int32, device=t.device)
    out = ops.paged_prefill_attention(q, zero, kv.k_cache, kv.v_cache, zero, empty, empty, backend=t.backend)
    assert out.shape == (0, 4, 64)
