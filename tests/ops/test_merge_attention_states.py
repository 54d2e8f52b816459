"""merge_attention_states: LSE-weighted combination of two partial attentions."""

import pytest
import torch

from helpers.targets import poison, randn, targets, to_ref
from minisched import ops
from minisched.ops import reference

TARGETS = targets("merge_attention_states")


def run(t, v_a, lse_a, v_b, lse_b):
    v_out, lse_out = poison(torch.empty_like(v_a)), poison(torch.empty_like(lse_a))
    ops.call_op("merge_attention_states", (v_a, lse_a, v_b, lse_b, v_out, lse_out), t.backend)
    return v_out, lse_out


def expected(v_a, lse_a, v_b, lse_b):
    va, vb = to_ref(v_a, v_b)
    v_out, lse_out = torch.empty_like(va), torch.empty(lse_a.shape)
    reference.merge_attention_states(va, lse_a.cpu(), vb, lse_b.cpu(), v_out, lse_out)
    return v_out, lse_out


@pytest.mark.parametrize("t", TARGETS)
@pytest.mark.parametrize("n,h,d", [(1, 1, 64), (7, 9, 64), (33, 8, 128)])
def test_matches_reference(t, n, h, d, gen):
    v_a, v_b = randn((n, h, d), t.dtype, t.device, gen), randn((n, h, d), t.dtype, t.device, gen)
    lse_a = (torch.randn((n, h), generator=gen) * 4).to(t.device)
    lse_b = (torch.randn((n, h), generator=gen) * 4).to(t.device)
    v, lse = run(t, v_a, lse_a, v_b, lse_b)
    ref_v, ref_lse = expected(v_a, lse_a, v_b, lse_b)
    torch.testing.assert_close(v.cpu().double(), ref_v, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", TARGETS)
def test_empty_sides(t, gen):
    """An empty partial (lse = -inf) contributes nothing; two empty ones give lse -inf and no NaN."""
    v_a, v_b = randn((3, 2, 64), t.dtype, t.device, gen), randn((3, 2, 64), t.dtype, t.device, gen)
    lse_a = torch.randn((3, 2), generator=gen).to(t.device)
    lse_b = torch.full((3, 2), float("-inf"), device=t.device)
    lse_b[2, 1] = 0.5
    lse_a[2, 1] = float("-inf")
    lse_a[1, 0] = float("-inf")
    lse_b[1, 0] = float("-inf")
    v, lse = run(t, v_a, lse_a, v_b, lse_b)
    ref_v, ref_lse = expected(v_a, lse_a, v_b, lse_b)
    assert not torch.isnan(v).any()
    torch.testing.assert_close(v.cpu().double(), ref_v, **t.tol)
    torch.testing.assert_close(lse.cpu(), ref_lse)
    assert lse[1, 0] == float("-inf")
    torch.testing.assert_close(v[0].cpu(), v_a[0].cpu())


@pytest.mark.parametrize("t", TARGETS)
def test_empty_batch(t, gen):
    v = randn((0, 4, 64), t.dtype, t.device, gen)
    lse = torch.empty((0, 4), device=t.device)
    v_out, lse_out = ops.merge_attention_states(v, lse, v, lse, backend=t.backend)
    assert v_out.shape == (0, 4, 64) and lse_out.shape == (0, 4)
