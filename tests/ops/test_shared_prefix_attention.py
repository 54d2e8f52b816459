"""shared_prefix_attention, and the cascade identity: prefix once per group + own suffix, merged
by LSE, equals plain paged decode over each whole sequence."""

import pytest
import torch

from helpers.paged_kv import make_paged_kv, without_pages
from helpers.targets import poison, randn, targets, to_ref
from minisched import ops
from minisched.base.page_table import build_csr
from minisched.ops import reference

TARGETS = targets("shared_prefix_attention")


def indptr_of(sizes, device):
    ip = [0]
    for n in sizes:
        ip.append(ip[-1] + n)
    return torch.tensor(ip, dtype=torch.int32, device=device)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size,head_dim,hq,hkv", [(1, 64, 4, 4), (16, 64, 9, 3), (16, 128, 8, 1), (1, 128, 6, 2)])
def test_matches_reference(t, page_size, head_dim, hq, hkv, gen):
    prefix_lens = [page_size, 3 * page_size + 1 if page_size > 1 else 40, 1]
    group_sizes = [3, 1, 2]
    kv = make_paged_kv(prefix_lens, page_size, hkv, head_dim, t.dtype, t.device, gen=gen)
    q = randn((sum(group_sizes), hq, head_dim), t.dtype, t.device, gen)
    gi = indptr_of(group_sizes, t.device)
    out, lse = poison(torch.empty_like(q)), poison(q.new_empty(q.shape[:2], dtype=torch.float32))
    ops.call_op("shared_prefix_attention", (q, gi, kv.k_cache, kv.v_cache, *kv.table, 0.1, out, lse), t.backend)
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    ref_out, ref_lse = torch.empty_like(q64), torch.empty(q.shape[:2])
    reference.shared_prefix_attention(q64, gi.cpu(), k64, v64, *to_ref(*kv.table), 0.1, ref_out, ref_lse)
    torch.testing.assert_close(out.cpu().double(), ref_out, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("long", [20, 300], ids=["one-split", "split-kv"])
def test_empty_prefix(t, long, gen):
    """A group whose prefix has no pages: its rows get out 0, lse -inf (merging it then keeps the suffix only)."""
    kv = without_pages(make_paged_kv([long, 5, 16], 16, 2, 64, t.dtype, t.device, gen=gen), {1})
    q = randn((6, 4, 64), t.dtype, t.device, gen)
    gi = indptr_of([2, 3, 1], t.device)
    out, lse = poison(torch.empty_like(q)), poison(q.new_empty(q.shape[:2], dtype=torch.float32))
    ops.call_op("shared_prefix_attention", (q, gi, kv.k_cache, kv.v_cache, *kv.table, 0.1, out, lse), t.backend)
    q64, k64, v64 = to_ref(q, kv.k_cache, kv.v_cache)
    ref_out, ref_lse = torch.empty_like(q64), torch.empty(q.shape[:2])
    reference.shared_prefix_attention(q64, gi.cpu(), k64, v64, *to_ref(*kv.table), 0.1, ref_out, ref_lse)
    assert bool((ref_out[2:5] == 0).all()) and bool((ref_lse[2:5] == float("-inf")).all())
    torch.testing.assert_close(out.cpu().double(), ref_out, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("t", TARGETS)
def test_empty_groups(t, gen):
    kv = make_paged_kv([16, 5], 16, 2, 64, t.dtype, t.device, gen=gen)
    q = randn((0, 4, 64), t.dtype, t.device, gen)
    out, lse = ops.shared_prefix_attention(
        q, torch.zeros(3, dtype=torch.int32, device=t.device), kv.k_cache, kv.v_cache, *kv.table, backend=t.backend
    )
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_equals_plain_decode(t, page_size, gen):
    """Two groups sharing page-aligned prefixes; each request has its own suffix pages."""
    hq, hkv, d = 8, 2, 64
    prefix_pages = [2, 1] if page_size == 16 else [24, 9]
    members = [3, 2]
    suffix_lens = [1, page_size, page_size + 3, 7, 2 * page_size]
    pool = make_paged_kv(
        [sum(prefix_pages) * page_size + 4 * page_size * len(suffix_lens)],
        page_size,
        hkv,
        d,
        t.dtype,
        t.device,
        gen=gen,
        spare_pages=0,
    )
    pages = torch.randperm(pool.k_cache.shape[0], generator=gen).tolist()
    group_prefix, pos = [], 0
    for n in prefix_pages:
        group_prefix.append(pages[pos : pos + n])
        pos += n
    full_lists, suffix_lists, full_lens = [], [], []
    r = 0
    for g, m in enumerate(members):
        for _ in range(m):
            n_suffix_pages = -(-suffix_lens[r] // page_size)
            own = pages[pos : pos + n_suffix_pages]
            pos += n_suffix_pages
            suffix_lists.append(own)
            full_lists.append(group_prefix[g] + own)
            full_lens.append(prefix_pages[g] * page_size + suffix_lens[r])
            r += 1

    def table(lists, lens):
        return [torch.from_numpy(a).to(t.device) for a in build_csr(lists, lens, page_size)]

    prefix_t = table(group_prefix, [n * page_size for n in prefix_pages])
    suffix_t = table(suffix_lists, suffix_lens)
    full_t = table(full_lists, full_lens)
    q = randn((sum(members), hq, d), t.dtype, t.device, gen)
    gi = indptr_of(members, t.device)
    cascade = ops.cascade_decode_attention(q, gi, pool.k_cache, pool.v_cache, prefix_t, suffix_t, backend=t.backend)
    plain = ops.paged_decode_attention(q, pool.k_cache, pool.v_cache, *full_t, backend=t.backend)
    torch.testing.assert_close(cascade.float(), plain.float(), **t.tol)
    q64, k64, v64 = to_ref(q, pool.k_cache, pool.v_cache)
    ref = torch.empty_like(q64)
    reference.paged_decode_attention(q64, k64, v64, *[x.cpu() for x in full_t], d**-0.5, ref)
    torch.testing.assert_close(cascade.cpu().double(), ref, **t.tol)
