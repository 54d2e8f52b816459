"""store_kv: new tokens' K/V written to their slots; negative slots skipped, everything else untouched."""

import pytest
import torch

from helpers.targets import randn, targets
from minisched import ops
from minisched.ops import reference

TARGETS = targets("store_kv")


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size,hkv,d", [(1, 4, 64), (16, 3, 64), (16, 1, 128), (16, 8, 128)])
@pytest.mark.parametrize("n", [0, 1, 16, 17, 300])
def test_matches_reference(t, page_size, hkv, d, n, gen):
    num_pages = -(-max(n, 1) // page_size) + 4
    k_cache = randn((num_pages, page_size, hkv, d), t.dtype, t.device, gen)
    v_cache = randn((num_pages, page_size, hkv, d), t.dtype, t.device, gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n].to(torch.int32)
    if n > 2:
        slots[1] = -1  # padding token: not written
    k, v = randn((n, hkv, d), t.dtype, t.device, gen), randn((n, hkv, d), t.dtype, t.device, gen)
    ref_k, ref_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    reference.store_kv(k.cpu(), v.cpu(), ref_k, ref_v, slots)
    ops.call_op("store_kv", (k, v, k_cache, v_cache, slots.to(t.device)), t.backend)
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)
    if n > 2:
        assert not torch.equal(ref_k, k_cache.new_zeros(ref_k.shape).cpu())
