"""silu_and_mul: SwiGLU's activation in one CPU pass, out = silu(gate) * up for x = [gate | up], against the
float64 reference and torch's own silu * up, with poisoned outputs, widths that are and are not multiples of
the 8-wide vector, one row and many (several threads' worth), the exp's clamped range and its edges (zeros,
large and tiny gates, infinities), empty sizes; every ISA variant gives the same bits and a row's result does
not depend on the rows around it; the op's input checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.targets import cpu_backends, poison
from minisched import ops
from minisched.ops import reference

# A CPU op (GPUs run torch's elementwise kernels): no CUDA or Triton kernel to test.
BACKENDS = cpu_backends()
NATIVE = BACKENDS[1:]


def inputs(m, d, gen, scale=4.0):
    return torch.randn(m, 2 * d, generator=gen) * scale


def expected(x):
    g, u = x.double().chunk(2, dim=-1)
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 64, 300])
@pytest.mark.parametrize("d", [1, 5, 8, 13, 64, 1536])
def test_matches_reference(backend, m, d, gen):
    x = inputs(m, d, gen)
    out = poison(torch.empty(m, d))
    before = x.clone()
    ops.call_op("silu_and_mul", (x, out), backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected(x), rtol=2e-6, atol=1e-30)
    assert torch.equal(x, before)  # the input is read only


@pytest.mark.parametrize("backend", NATIVE)
def test_error_over_the_whole_range(backend):
    """Gates across the whole range the exp sees (|g| up to 100, past its +-88.38 clamp): within a few
    float32 ulps of float64's silu(g) * u where the result is a normal float, ~0 below, exactly g * u where
    silu(g) rounds to g."""
    g = torch.cat((torch.linspace(-100, 100, 200001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0])))
    x = torch.cat((g, torch.ones_like(g))).view(1, -1)
    out = ops.silu_and_mul(x, backend=backend)[0].double()
    want = expected(x)[0]
    normal = want.abs() > 1e-30
    rel = ((out - want).abs() / want.abs())[normal].max().item()
    assert rel < 4 * 2.0**-24, rel  # 4 ulp (the exp, one product, one division, one product)
    assert ((out - want).abs()[~normal] < 1e-35).all()  # exp is 0 below -87.3: silu(g) ~ g e^g, tiny
    assert torch.equal(out[g >= 20], g[g >= 20].double())


@pytest.mark.parametrize("backend", NATIVE)
def test_infinities_and_nan(backend):
    """+inf passes, -inf gives NaN (torch's silu does the same: -inf / inf), NaN stays NaN in either half."""
    x = torch.tensor([[math.inf, -math.inf, math.nan, 1.0, 2.0, 2.0, 2.0, math.nan]])
    out = ops.silu_and_mul(x, backend=backend)[0]
    assert out[0] == math.inf and out[1:].isnan().all()
    assert (F.silu(x[0, :4]) * x[0, 4:])[1].isnan()


@pytest.mark.parametrize("backend", NATIVE)
def test_matches_torchs_silu_mul(backend, gen):
    """The model's torch path (F.silu(gate) * up) and this op agree to float32 rounding."""
    x = inputs(33, 1536, gen)
    g, u = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x, backend=backend), F.silu(g) * u, rtol=3e-6, atol=1e-6)


def test_every_isa_variant_gives_the_same_bits(gen):
    if not ops.native_available():
        pytest.skip(ops.NATIVE_ERROR)
    x = inputs(70, 1541, gen)
    outs = {}
    for isa in ops.cpu_features()["supported"]:
        with ops.use_cpu_isa(isa):
            outs[isa] = ops.silu_and_mul(x)
    first = next(iter(outs.values()))
    assert all(torch.equal(first, o) for o in outs.values()), list(outs)


@pytest.mark.parametrize("backend", NATIVE)
def test_row_results_do_not_depend_on_the_batch(backend, gen):
    x = inputs(200, 1536, gen)
    assert torch.equal(ops.silu_and_mul(x, backend=backend)[37:38], ops.silu_and_mul(x[37:38].clone(), backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,d", [(0, 64), (3, 0), (0, 0)])
def test_empty_sizes(backend, m, d):
    assert ops.silu_and_mul(torch.zeros(m, 2 * d), backend=backend).shape == (m, d)


def test_reference_is_the_definition(gen):
    x = inputs(4, 16, gen).double()
    out = torch.empty(4, 16, dtype=torch.float64)
    reference.silu_and_mul(x, out)
    torch.testing.assert_close(out, F.silu(x[:, :16]) * x[:, 16:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("x_dtype", TypeError, "dtype"),
        ("out_dtype", TypeError, "dtype"),
        ("x_dims", ValueError, "dims"),
        ("x_odd", ValueError, "even"),
        ("out_shape", ValueError, "out"),
        ("x_strided", ValueError, "contiguous"),
        ("out_strided", ValueError, "contiguous"),
        ("out_overlaps_x", ValueError, "overlaps"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x, out = inputs(3, 64, gen), torch.empty(3, 64)
    if case == "x_dtype":
        x = x.half()
    elif case == "out_dtype":
        out = out.half()
    elif case == "x_dims":
        x = x.reshape(3, 8, 16)
    elif case == "x_odd":
        x = torch.randn(3, 127, generator=gen)
    elif case == "out_shape":
        out = torch.empty(3, 128)
    elif case == "x_strided":
        x = torch.randn(128, 3, generator=gen).T
    elif case == "out_strided":
        out = torch.empty(64, 3).T
    elif case == "out_overlaps_x":
        out = x.view(-1)[64 : 64 + 3 * 64].view(3, 64)
    with pytest.raises(exc, match=words):
        ops.call_op("silu_and_mul", (x, out), backend)
