"""rope: half-rotation RoPE in one CPU pass from a (strided) [N, H, D] view into a contiguous out, against
the float64 reference and, bit for bit, torch's x * cos + rotate_half(x) * sin (the model's own torch path),
with poisoned outputs, head dims that are and are not multiples of the 8-wide vector, the q and k column
views of a fused qkv row, one token and many (several threads' worth), real positions' angles, empty sizes;
every ISA variant gives the same bits; the op's input checks."""

import pytest
import torch

from helpers.targets import cpu_backends, poison
from minisched import ops
from minisched.model.llama import apply_rope, apply_rope_signed, rope_cos_sin, signed_sin
from minisched.ops import reference

# A CPU op (GPUs run torch's elementwise kernels): no CUDA or Triton kernel to test.
BACKENDS = cpu_backends()
NATIVE = BACKENDS[1:]


def angles(n, d, gen, theta=1e5):
    """cos, sin [n, d/2] of real (shuffled, large) positions, as the model computes them."""
    positions = torch.randint(0, 9000, (n,), generator=gen)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(positions, inv, torch.float32)  # [n, 1, d], both halves the same
    return cos[:, 0, : d // 2].contiguous(), sin[:, 0, : d // 2].contiguous()


def expected(x, cos, sin):
    out = torch.empty(x.shape, dtype=torch.float64)
    reference.rope(x.double(), cos.double(), sin.double(), out)
    return out


def qkv_views(n, hq, hkv, d, gen):
    """A fused qkv projection's output [n, (hq + 2 hkv) d] and its q and k views [n, h, d] (strided rows)."""
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen) * 3
    return qkv, qkv[:, : hq * d].view(n, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 5, 300])
@pytest.mark.parametrize("h", [1, 3, 9])
@pytest.mark.parametrize("d", [2, 6, 16, 34, 64, 128])
def test_matches_reference(backend, n, h, d, gen):
    x = torch.randn(n, h, d, generator=gen) * 3
    cos, sin = angles(n, d, gen)
    out = poison(torch.empty(n, h, d))
    before = x.clone()
    ops.call_op("rope", (x, cos, sin, out), backend)
    assert not out.isnan().any()
    # |x c - y s| rounds each product and the sum: 2 ulps of the larger term, bounded by |x| + |y|
    scale = x.abs() + x.roll(d // 2, dims=-1).abs()
    assert ((out.double() - expected(x, cos, sin)).abs() <= 2 * 2.0**-24 * scale.double()).all()
    assert torch.equal(x, before)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (2, 1, 6)])
def test_qkv_views_bitwise_torchs_rope(backend, hq, hkv, d, gen):
    """From the strided q and k column views of a fused qkv output: bitwise the model's torch path
    (apply_rope and apply_rope_signed), contiguous."""
    n = 70
    qkv, q, k = qkv_views(n, hq, hkv, d, gen)
    positions = torch.randint(0, 9000, (n,), generator=gen)
    inv = 1.0 / (1e5 ** (torch.arange(0, d, 2).float() / d))
    cos_full, sin_full = rope_cos_sin(positions, inv, torch.float32)
    cos, sin = cos_full[:, 0, : d // 2].contiguous(), sin_full[:, 0, : d // 2].contiguous()
    before = qkv.clone()
    for view in (q, k):
        got = ops.rope(view, cos, sin, backend=backend)
        assert got.is_contiguous()
        assert torch.equal(got, apply_rope(view, cos_full, sin_full))
        assert torch.equal(got, apply_rope_signed(view, cos_full, signed_sin(sin_full)))
    assert torch.equal(qkv, before)


def test_every_isa_variant_gives_the_same_bits(gen):
    if not ops.native_available():
        pytest.skip(ops.NATIVE_ERROR)
    _, q, _ = qkv_views(37, 9, 3, 66, gen)
    cos, sin = angles(37, 66, gen)
    outs = {}
    for isa in ops.cpu_features()["supported"]:
        with ops.use_cpu_isa(isa):
            outs[isa] = ops.rope(q, cos, sin)
    first = next(iter(outs.values()))
    assert all(torch.equal(first, o) for o in outs.values()), list(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,h,d", [(0, 3, 64), (3, 0, 64), (3, 2, 0)])
def test_empty_sizes(backend, n, h, d):
    out = ops.rope(torch.zeros(n, h, d), torch.zeros(n, d // 2), torch.zeros(n, d // 2), backend=backend)
    assert out.shape == (n, h, d)


def test_reference_is_the_definition(gen):
    x = torch.randn(4, 2, 8, generator=gen, dtype=torch.float64)
    cos, sin = (
        torch.rand(4, 4, generator=gen, dtype=torch.float64),
        torch.rand(4, 4, generator=gen, dtype=torch.float64),
    )
    out = torch.empty_like(x)
    reference.rope(x, cos, sin, out)
    torch.testing.assert_close(
        out, apply_rope(x, torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None])
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("x_dtype", TypeError, "dtype"),
        ("cos_dtype", TypeError, "dtype"),
        ("x_dims", ValueError, "dims"),
        ("d_odd", ValueError, "even"),
        ("x_last_strided", ValueError, "stride"),
        ("cos_shape", ValueError, "cos"),
        ("sin_shape", ValueError, "sin"),
        ("out_shape", ValueError, "out"),
        ("out_strided", ValueError, "contiguous"),
        ("out_is_x", ValueError, "overlaps"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x = torch.randn(3, 2, 8, generator=gen)
    cos, sin, out = torch.rand(3, 4), torch.rand(3, 4), torch.empty(3, 2, 8)
    if case == "x_dtype":
        x = x.half()
    elif case == "cos_dtype":
        cos = cos.double()
    elif case == "x_dims":
        x = x.view(3, 16)
    elif case == "d_odd":
        x, out = torch.randn(3, 2, 7, generator=gen), torch.empty(3, 2, 7)
    elif case == "x_last_strided":
        x = torch.randn(3, 2, 16, generator=gen)[:, :, ::2]
    elif case == "cos_shape":
        cos = torch.rand(3, 8)
    elif case == "sin_shape":
        sin = torch.rand(2, 4)
    elif case == "out_shape":
        out = torch.empty(3, 2, 9)
    elif case == "out_strided":
        out = torch.empty(3, 8, 2).transpose(1, 2)
    elif case == "out_is_x":
        out = x
    with pytest.raises(exc, match=words):
        ops.call_op("rope", (x, cos, sin, out), backend)
