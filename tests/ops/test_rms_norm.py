"""rms_norm: the fused CPU RMSNorm (optionally after the residual add x += delta), against the float64
reference and against the model's own `rms_norm`, with poisoned outputs, widths that are and are not
multiples of the 8- and 16-wide vectors, one row and many (several threads' worth), empty sizes; a row's result
does not depend on the batch around it; the op's input checks."""

import pytest
import torch

from helpers.targets import cpu_backends, poison
from minisched import ops
from minisched.ops import reference

# A CPU op (the CPU's per-op overhead; GPUs use torch's fused norm): no CUDA or Triton kernel to test.
BACKENDS = cpu_backends()  # torch, and native once per ISA variant this machine runs
NATIVE = BACKENDS[1:]


def inputs(m, d, gen):
    # rows of different scales, so a row normalized with another row's rms shows
    x = torch.randn(m, d, generator=gen) * (torch.rand(m, 1, generator=gen) * 10 + 0.1)
    return x, torch.randn(m, d, generator=gen), torch.randn(d, generator=gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "with-residual-add"])
@pytest.mark.parametrize("m", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("d", [1, 5, 8, 13, 20, 64, 576])
def test_matches_reference(backend, fused, m, d, gen):
    x, delta, w = inputs(m, d, gen)
    x64, d64 = x.double(), delta.double()
    summed = x64 + d64 if fused else x64
    expected = w.double() * summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = poison(torch.empty(m, d))
    got_x = x.clone()
    ops.call_op("rms_norm", (got_x, delta if fused else None, w, 1e-5, out), backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    # the residual stream: x + delta written back when fused, untouched otherwise
    torch.testing.assert_close(got_x.double(), summed, rtol=0, atol=1e-6 * summed.abs().max().item())
    if not fused:
        assert torch.equal(got_x, x)


@pytest.mark.parametrize("backend", NATIVE)
def test_matches_the_models_norm(backend, gen):
    """The engine swaps the model's float32 rms_norm for this op: same values to float32 rounding."""
    from minisched.model.llama import rms_norm

    x, _, w = inputs(33, 576, gen)
    got = ops.rms_norm(x, w, 1e-5, backend=backend)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", NATIVE)
def test_row_results_do_not_depend_on_the_batch(backend, gen):
    x, delta, w = inputs(200, 576, gen)
    whole_x, part_x = x.clone(), x[37:38].clone()
    whole = ops.rms_norm(whole_x, w, 1e-6, delta=delta, backend=backend)
    part = ops.rms_norm(part_x, w, 1e-6, delta=delta[37:38].clone(), backend=backend)
    assert torch.equal(whole[37:38], part) and torch.equal(whole_x[37:38], part_x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,d", [(0, 64), (3, 0), (0, 0)])
def test_empty_sizes(backend, m, d):
    x, w = torch.zeros(m, d), torch.ones(d)
    out = ops.rms_norm(x, w, 1e-5, delta=torch.zeros(m, d), backend=backend)
    assert out.shape == (m, d)


def test_reference_is_the_definition(gen):
    x, delta, w = inputs(4, 16, gen)
    out = torch.empty(4, 16, dtype=torch.float64)
    xr = x.clone().double()
    reference.rms_norm(xr, delta.double(), w.double(), 1e-5, out)
    s = x.double() + delta.double()
    torch.testing.assert_close(out, w.double() * s / s.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("x_dtype", TypeError, "dtype"),
        ("w_dtype", TypeError, "dtype"),
        ("x_dims", ValueError, "dims"),
        ("w_len", ValueError, "weight"),
        ("out_shape", ValueError, "out"),
        ("delta_shape", ValueError, "delta"),
        ("x_strided", ValueError, "contiguous"),
        ("eps_zero", ValueError, "eps"),
        ("eps_nan", ValueError, "eps"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x, delta, w = inputs(3, 64, gen)
    out, eps = torch.empty(3, 64), 1e-5
    if case == "x_dtype":
        x = x.half()
    elif case == "w_dtype":
        w = w.half()
    elif case == "x_dims":
        x = x.reshape(3, 8, 8)
    elif case == "w_len":
        w = torch.ones(63)
    elif case == "out_shape":
        out = torch.empty(3, 65)
    elif case == "delta_shape":
        delta = torch.ones(2, 64)
    elif case == "x_strided":
        x = torch.randn(64, 3, generator=gen).T
    elif case == "eps_zero":
        eps = 0.0
    elif case == "eps_nan":
        eps = float("nan")
    with pytest.raises(exc, match=words):
        ops.call_op("rms_norm", (x, delta, w, eps, out), backend)
