"""packed_linear: the float32 matmul on 16-column weight panels, against the float64 reference, with
poisoned outputs, every micro-kernel shape (1..6 rows x 1..4 panels, balanced row blocks, a partial
last panel), strided rows, empty and degenerate sizes; its results are the same bits whatever the
batch around a row and the thread count; pack/unpack round-trips; the op's input checks."""

import pytest
import torch

from helpers import amx_emulation
from helpers.targets import CPU_ISAS, cpu_backends, poison
from minisched import ops
from minisched.ops import reference

# A CPU op (the CPU's small-batch projections; GPUs use cuBLAS): no CUDA or Triton kernel to test.
BACKENDS = cpu_backends()  # torch, and native once per ISA variant this machine runs
NATIVE = BACKENDS[1:]


def run(x, w, backend, out=None):
    out = poison(torch.empty(x.shape[0], w.shape[0])) if out is None else out
    ops.call_op("packed_linear", (x, ops.pack_linear_weight(w), out), backend)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 100])
# n: one partial panel, exactly one, one + 1 column, 5 panels (4 + 1 at one row), 61 columns (a
# partial 4th panel); k: 1, odd, the model's sizes
@pytest.mark.parametrize("n,k", [(1, 64), (16, 3), (17, 1), (80, 576), (61, 1536), (40, 7)])
def test_matches_reference(backend, m, n, k, gen):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    expected = torch.empty(m, n, dtype=torch.float64)
    reference.packed_linear(x, reference.pack_linear_weight(w), expected)
    torch.testing.assert_close(expected, x.double() @ w.double().T)  # the reference itself
    out = run(x, w, backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 20])
def test_strided_rows(backend, m, gen):
    """x may be a column slice of a wider activation (e.g. the gate half of gate_up)."""
    wide = torch.randn(m, 2 * 128, generator=gen)
    x = wide[:, 128:]
    assert x.stride(0) == 256  # (one row counts as contiguous; its stride is still 256)
    w = torch.randn(40, 128, generator=gen)
    torch.testing.assert_close(run(x, w, backend), x.contiguous() @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k", [(0, 8, 64), (3, 0, 64), (3, 8, 0), (0, 0, 0)])
def test_empty_sizes(backend, m, n, k):
    x = torch.randn(m, k)
    out = poison(torch.empty(m, n))
    ops.call_op("packed_linear", (x, ops.pack_linear_weight(torch.randn(n, k)), out), backend)
    assert out.shape == (m, n)
    assert (out == 0).all()  # K = 0: an empty sum (no-op for the rest: nothing to write)


@pytest.mark.parametrize("backend", NATIVE)
def test_row_results_do_not_depend_on_the_batch(backend, gen):
    """Each output is one fused multiply-add chain over k in order, whatever block a row falls in:
    a request's logits are the same bits alone or in any batch (batch invariance)."""
    x = torch.randn(23, 576, generator=gen)
    w = torch.randn(100, 576, generator=gen)
    whole = run(x, w, backend)
    for m0, m1 in ((0, 1), (5, 7), (3, 6), (10, 18), (0, 23)):
        assert torch.equal(run(x[m0:m1], w, backend), whole[m0:m1]), (m0, m1)


@pytest.mark.skipif(len(CPU_ISAS) < 2, reason="one ISA variant on this machine")
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 23, 64])
def test_every_isa_gives_the_same_bits(m, gen):
    """Every variant computes each output as the same FMA chain (k in order, from zero): AVX-512's
    16-wide panels and 8-row blocks give AVX2's bits exactly."""
    x = torch.randn(m, 576, generator=gen)
    w = torch.randn(200, 576, generator=gen)  # 12.5 panels: a partial last one
    got = {}
    for isa in CPU_ISAS:
        with ops.use_cpu_isa(isa):
            got[isa] = run(x, w, "native")
    for isa in CPU_ISAS[1:]:
        assert torch.equal(got[isa], got[CPU_ISAS[0]]), isa


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 8, 15, 16, 17, 64])  # the widening in registers, and from 16 rows in buffers
@pytest.mark.parametrize("n,k", [(16, 64), (61, 1536), (200, 576)])
def test_bf16_weights_are_the_float32_kernel_on_the_rounded_weight(backend, m, n, k, gen):
    """bfloat16 panels (`--quantize bf16`) are widened as they are read: the result is packed_linear's on
    the bf16-rounded float32 weight, bit for bit on the native backend -- except AMX from 16 rows on,
    which sums the same products in another order (test_amx_bf16_is_float32_accurate)."""
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).bfloat16()
    got = run(x, w, backend)
    assert ops.pack_linear_weight(w).dtype == torch.bfloat16
    want = run(x, w.float(), backend)
    if backend == "native" and not (ops.cpu_isa() == "amx" and m >= 16):
        assert torch.equal(got, want)
    else:  # float32 sums in another order (as test_matches_reference's tolerance)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.skipif("amx" not in CPU_ISAS, reason="no AMX variant on this machine (test_int8_linear says why)")
@pytest.mark.parametrize("m", [16, 17, 40, 64])
@pytest.mark.parametrize("n,k", [(16, 64), (61, 1536), (200, 576), (5, 96)])
def test_amx_bf16_is_float32_accurate(m, n, k, gen):
    """From 16 rows on AMX sums bf16 weights times float32 activations split exactly into three bf16
    terms: its error against float64 is the FMA chain's size (within 4x the AVX-512 kernel's), far
    below what bf16-rounded activations would give; poisoned outputs, partial panels and row tiles."""
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(n, k, generator=gen).bfloat16()
    exact = x.double() @ w.double().T
    with ops.use_cpu_isa("amx"):
        amx = run(x, w, "native")
    with ops.use_cpu_isa("avx512"):
        fma = run(x, w, "native")
    assert not amx.isnan().any()
    err_amx = (amx.double() - exact).abs().max().item()
    err_fma = (fma.double() - exact).abs().max().item()
    err_bf16_x = ((x.bfloat16().double() @ w.double().T) - exact).abs().max().item()
    assert err_amx <= 4 * err_fma + 1e-6 * exact.abs().max().item(), (err_amx, err_fma)
    assert err_amx < err_bf16_x / 20, (err_amx, err_bf16_x)
    rows = torch.randperm(m, generator=gen)[:5]
    with ops.use_cpu_isa("amx"):  # a row does not depend on the other rows of its tiles
        assert torch.equal(run(x[rows].repeat(4, 1)[:16], w, "native")[:5], amx[rows])


def test_amx_bf16_split_and_tiles_emulated(gen):
    """The AMX bf16 variant's arithmetic, emulated (checked on machines without AMX too): the three
    bf16 terms sum exactly to x, and the relaid-out B-tile rows pair each column's channels so that
    the tile dot products of the terms give x @ w.T of the rounded weight (float64: exact products)."""
    k, n = 576, 32
    x = torch.randn(7, k, generator=gen) * torch.logspace(-20, 20, 7)[:, None]
    hi, mid, lo = amx_emulation.bf16_split(x)
    assert torch.equal(hi.double() + mid.double() + lo.double(), x.double())
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = ops.pack_linear_weight(w)
    for p in range(n // 16):
        b = amx_emulation.bf16_b_tiles(packed[p])
        got = sum(amx_emulation.tile_dot_bf16(t, b) for t in (hi, mid, lo))
        torch.testing.assert_close(got, x.double() @ w[16 * p : 16 * p + 16].double().T, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", NATIVE)
def test_thread_count_does_not_change_bits(backend, gen):
    x = torch.randn(9, 576, generator=gen)
    w = torch.randn(3072, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, w, backend)
        torch.set_num_threads(2)
        two = run(x, w, backend)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_pack_round_trip(gen):
    w = torch.randn(37, 11, generator=gen)
    p = ops.pack_linear_weight(w)
    assert p.shape == (3, 11, 16) and p.is_contiguous()
    assert torch.equal(p[1, 4, 5], w[21, 4]) and (p[2, :, 5:] == 0).all()  # zero past N
    assert torch.equal(reference.unpack_linear_weight(p, 37), w)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        ops.pack_linear_weight(torch.randn(4, 4, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapper(backend, gen):
    x, w = torch.randn(5, 64, generator=gen), torch.randn(33, 64, generator=gen)
    got = ops.packed_linear(x, ops.pack_linear_weight(w), 33, backend=backend)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("x_dtype", TypeError, "dtype"),
        ("w_dtype", TypeError, "dtype"),  # float16 panels: only float32 and bfloat16
        ("w_dims", ValueError, "dims"),
        ("k_mismatch", ValueError, "w_packed has shape"),
        ("panels", ValueError, "w_packed has shape"),
        ("out_rows", ValueError, "shape"),
        ("x_cols_strided", ValueError, "contiguous rows"),
        ("w_strided", ValueError, "contiguous"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x = torch.randn(3, 64, generator=gen)
    w = ops.pack_linear_weight(torch.randn(20, 64, generator=gen))  # 2 panels
    out = torch.empty(3, 20)
    if case == "x_dtype":
        x = x.half()
    elif case == "w_dtype":
        w = w.half()
    elif case == "w_dims":
        w = w.reshape(2, -1)
    elif case == "k_mismatch":
        x = torch.randn(3, 96, generator=gen)
    elif case == "panels":
        out = torch.empty(3, 40)  # 3 panels needed
    elif case == "out_rows":
        out = torch.empty(4, 20)
    elif case == "x_cols_strided":
        x = torch.randn(64, 3, generator=gen).T
    elif case == "w_strided":
        w = torch.randn(2, 16, 64, generator=gen).transpose(1, 2)
    with pytest.raises(exc, match=words):
        ops.call_op("packed_linear", (x, w, out), backend)
