"""copy_kv_pages, gather_kv_pages, scatter_kv_pages: whole pages, every layer, K and V."""

import pytest
import torch

from helpers.targets import randn, targets
from minisched import ops
from minisched.ops import reference

TARGETS = targets("kv_pages")


def pool(t, layers, pages, page_size, hkv, d, gen):
    return randn((layers, 2, pages, page_size, hkv, d), t.dtype, t.device, gen)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size,hkv,d", [(1, 4, 64), (16, 3, 64), (16, 8, 128)])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_copy(t, page_size, hkv, d, n, gen):
    kv = pool(t, 3, 12, page_size, hkv, d, gen)
    perm = torch.randperm(12, generator=gen).to(torch.int32)
    src, dst = perm[:n], perm[6 : 6 + n]
    ref = kv.cpu().clone()
    reference.copy_kv_pages(ref, src, dst)
    ops.call_op("copy_kv_pages", (kv, src.to(t.device), dst.to(t.device)), t.backend)
    assert torch.equal(kv.cpu(), ref)


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("page_size,hkv,d", [(1, 4, 64), (16, 3, 64), (16, 8, 128)])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_gather_then_scatter_roundtrip(t, page_size, hkv, d, n, gen):
    kv = pool(t, 2, 10, page_size, hkv, d, gen)
    pages = torch.randperm(10, generator=gen)[:n].to(torch.int32)
    out = torch.full((2, 2, n, page_size, hkv, d), float("nan"), dtype=t.dtype, device=t.device)
    ops.call_op("gather_kv_pages", (kv, pages.to(t.device), out), t.backend)
    assert torch.equal(out.cpu(), kv.cpu()[:, :, pages.long()])
    # evict: overwrite the pages, then reload them from the buffer
    before = kv.cpu().clone()
    kv[:, :, pages.long().to(t.device)] = 0
    ops.call_op("scatter_kv_pages", (out, kv, pages.to(t.device)), t.backend)
    assert torch.equal(kv.cpu(), before)


@pytest.mark.parametrize("t", TARGETS)
def test_gather_to_host_buffer(t, gen):
    """The offload path: a device pool gathered into (pinned when CUDA) host memory and back."""
    kv = pool(t, 2, 8, 16, 2, 64, gen)
    pages = torch.tensor([5, 0, 3], dtype=torch.int32, device=t.device)
    host = torch.empty((2, 2, 3, 16, 2, 64), dtype=t.dtype, pin_memory=t.device == "cuda")
    ops.gather_kv_pages(kv, pages, host, backend=t.backend)
    if t.device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host, kv.cpu()[:, :, [5, 0, 3]])
    fresh = torch.zeros_like(kv)
    ops.scatter_kv_pages(host, fresh, pages, backend=t.backend)
    assert torch.equal(fresh.cpu()[:, :, [5, 0, 3]], host)
