"""int8_linear: weight-only int8 matmul against the float64 reference, on both native paths
(fused decode kernel up to 16 rows, dequantized panels + packed_linear's micro-kernel from 17),
poisoned outputs, strided rows, edge cases; quantize_int8's error bound; the op's input checks."""

import pytest
import torch

from helpers.targets import cpu_backends, poison
from minisched import ops
from minisched.ops import reference

# A CPU op (weight-only int8 for bandwidth-bound CPU decode): no CUDA or Triton kernel to test;
# asking the triton backend for it is a clear error (test_triton_backend_is_a_clear_error).
BACKENDS = cpu_backends()  # torch, and native once per ISA variant this machine runs


def random_weights(n, k, group, gen):
    """Random int8 values over the whole range and positive scales that differ per group."""
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    return w_q, scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 15, 16, 17, 64])
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (9, 64, 32), (96, 576, 64), (200, 1536, 64), (33, 576, 576)])
def test_matches_reference(backend, m, n, k, group, gen):
    x = torch.randn(m, k, generator=gen)
    w_q, scales = random_weights(n, k, group, gen)
    expected = torch.empty(m, n, dtype=torch.float64)
    reference.int8_linear(x, w_q, scales, expected)
    out = poison(torch.empty(m, n))
    ops.call_op("int8_linear", (x, w_q, scales, out), backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))
@pytest.mark.parametrize("m", [17, 23, 100])
@pytest.mark.parametrize("n,k,group", [(9, 64, 32), (200, 1536, 64), (33, 576, 576)])
def test_many_rows_equal_packed_fp32_bitwise(m, n, k, group, gen):
    """From 17 rows the weight is dequantized panel by panel (an 8 x 8 register transpose) and run through
    packed_linear's micro-kernel: the result must be packed_linear on the dequantized weight, bit for bit
    (any misplaced, unscaled or stale panel element would show), and each row must not depend on the others."""
    x = torch.randn(m, k, generator=gen)
    w_q, scales = random_weights(n, k, group, gen)
    w = w_q.float() * scales.repeat_interleave(group, dim=1)  # float(w) * scale, as the kernel rounds it
    out = poison(torch.empty(m, n))
    ops.int8_linear(x, w_q, scales, out=out)
    expected = ops.packed_linear(x, ops.pack_linear_weight(w), n)
    assert torch.equal(out, expected)
    first = ops.int8_linear(x[:17].clone(), w_q, scales)  # the same rows in a smaller batch
    assert torch.equal(first, out[:17])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [3, 20])
def test_strided_rows(backend, m, gen):
    """x may be a column slice of a wider activation (e.g. the gate half of gate_up)."""
    wide = torch.randn(m, 2 * 128, generator=gen)
    x = wide[:, 128:]
    assert x.stride(0) == 256 and not x.is_contiguous()
    w_q, scales = random_weights(40, 128, 32, gen)
    out = poison(torch.empty(m, 40))
    ops.call_op("int8_linear", (x, w_q, scales, out), backend)
    torch.testing.assert_close(out, x.contiguous() @ reference.dequantize_int8(w_q, scales).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend, gen):
    w_q, scales = random_weights(8, 64, 32, gen)
    out = torch.empty(0, 8)
    ops.call_op("int8_linear", (torch.empty(0, 64), w_q, scales, out), backend)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapper_end_to_end(backend, gen):
    """quantize -> int8_linear stays within the quantization error of the fp32 matmul."""
    w = torch.randn(300, 576, generator=gen) * 0.05
    x = torch.randn(6, 576, generator=gen)
    w_q, scales = ops.quantize_int8(w, group_size=64)
    got = ops.int8_linear(x, w_q, scales, backend=backend)
    exact = x @ w.T
    # each weight is off by at most scale/2; the error of a dot product grows like sqrt(K)
    err = (got - exact).abs().max().item()
    assert 0 < err < 0.05 * exact.abs().max().item()


def test_quantize_int8_round_trip(gen):
    w = torch.randn(64, 256, generator=gen)
    w[3, :64] = 0.0  # an all-zero group stays zero
    w_q, scales = ops.quantize_int8(w, group_size=64)
    assert w_q.dtype == torch.int8 and scales.shape == (64, 4)
    assert w_q.abs().max() == 127 and (scales[3, 0] == 0) and (w_q[3, :64] == 0).all()
    back = reference.dequantize_int8(w_q, scales)
    bound = scales.repeat_interleave(64, dim=1) / 2 + 1e-7
    assert ((back - w).abs() <= bound).all()


@pytest.mark.parametrize("group", [0, 16, 48, 100])
def test_quantize_int8_bad_group(group):
    with pytest.raises(ValueError, match="group_size"):
        ops.quantize_int8(torch.randn(4, 192), group_size=group)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("x_dtype", TypeError, "dtype"),
        ("w_dtype", TypeError, "dtype"),
        ("k_mismatch", ValueError, "shape"),
        ("bad_group", ValueError, "multiple of 32"),
        ("out_shape", ValueError, "shape"),
        ("x_cols_strided", ValueError, "contiguous rows"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x = torch.randn(3, 64, generator=gen)
    w_q, scales = random_weights(8, 64, 32, gen)
    out = torch.empty(3, 8)
    if case == "x_dtype":
        x = x.half()
    elif case == "w_dtype":
        w_q = w_q.to(torch.int16)
    elif case == "k_mismatch":
        x = torch.randn(3, 96, generator=gen)
    elif case == "bad_group":
        scales = torch.rand(8, 4, generator=gen)  # group 16
    elif case == "out_shape":
        out = torch.empty(3, 9)
    elif case == "x_cols_strided":
        x = torch.randn(64, 3, generator=gen).T
    with pytest.raises(exc, match=words):
        ops.call_op("int8_linear", (x, w_q, scales, out), backend)


def test_triton_backend_is_a_clear_error(gen):
    w_q, scales = random_weights(8, 64, 32, gen)
    with pytest.raises(ValueError, match="no triton kernel"):
        ops.call_op("int8_linear", (torch.randn(2, 64), w_q, scales, torch.empty(2, 8)), "triton")


def test_opcheck(gen):
    if not ops.native_available():
        pytest.skip(ops.NATIVE_ERROR)
    w_q, scales = random_weights(8, 64, 32, gen)
    torch.library.opcheck(
        torch.ops.minisched.int8_linear.default, (torch.randn(3, 64, generator=gen), w_q, scales, torch.empty(3, 8))
    )
