"""gguf_a8_linear: a GGUF file's blocks (Q4_0, Q4_1, Q8_0) against activations rounded to 8 bits per
block of 32 channels, summed in int32, on every ISA variant the machine runs: against the float64
reference of the exactly dequantized blocks times the rounded activations (reference.quantize_a8),
within the float32 rounding of its per-block scale steps; the activations' rounding itself exactly
(half to even, one-hot weights read the rounded values back); the same bits on every ISA, thread count
and batch position; non-finite and all-zero blocks; poisoned outputs, odd row counts, strided rows; the
packing round trip; the op's input checks."""

import numpy as np
import pytest
import torch

from helpers.targets import CPU_ISAS, cpu_backends, poison
from minisched import ops
from minisched.ops import reference

# gguf is a dependency of the package, but the GPU device image has none (its tests stage collects tests/ops)
gguf = pytest.importorskip(
    "gguf", reason="the gguf package is not installed (the device image has none)", exc_type=ImportError
)
GGMLQuantizationType = gguf.GGMLQuantizationType
gguf_quantize = gguf.quantize

# A CPU op (llama.cpp's trade for the CPU's single-stream decode): no CUDA or Triton kernel to test.
BACKENDS = cpu_backends()  # torch, and native once per ISA variant this machine runs
QTYPES = [pytest.param(q, id=name) for name, q in ops.GGUF_QTYPES.items()]
native = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))


def random_blocks(n, k, qtype, gen):
    """gguf's own quantization of a random weight (rows of different scales, some one-signed so Q4_1's
    m is not always negative): uint8 blocks [n, k / 32 * block bytes]."""
    w = torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) * 0.1 + 0.01)
    w[::3] = w[::3].abs()
    blocks = gguf_quantize(w.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(n, -1)


def run(x, w_packed, qtype, n, backend):
    out = poison(torch.empty(x.shape[0], n))
    ops.call_op("gguf_a8_linear", (x, w_packed, qtype, out), backend)
    return out


def magnitude(x, blocks, qtype):
    """Per output, the float64 sum of |x^| times the weight's parts taken positive (|d| q + |m| for
    Q4_1, |w| otherwise): what the kernel's per-block float32 steps round against."""
    size = reference.GGUF_BLOCK_BYTES[qtype]
    b = blocks.clone().view(blocks.shape[0], -1, size)
    b[..., 1] &= 0x7F  # d's sign bit (fp16, little-endian)
    if qtype == 3:
        b[..., 3] &= 0x7F  # m's
    w_abs = reference.dequantize_gguf(b.reshape(blocks.shape), qtype, torch.float64).abs()
    xq, dx = reference.quantize_a8(x)
    xh = (xq.double().view(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)
    return xh.abs() @ w_abs.T


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 17])
# n: one partial panel, a partial 2nd, 6 panels (qkv-like), 12.5 panels; K: 1 block, 2, 18 (576), 48 (1536)
@pytest.mark.parametrize("n,k", [(1, 32), (9, 64), (96, 576), (200, 1536)])
def test_matches_reference(backend, qtype, m, n, k, gen):
    x = torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 10 + 0.1)
    blocks = random_blocks(n, k, qtype, gen)
    w_packed = ops.pack_gguf_a8_weight(blocks, qtype)
    expected = torch.empty(m, n, dtype=torch.float64)
    reference.gguf_a8_linear(x, w_packed, qtype, expected)
    out = run(x, w_packed, qtype, n, backend)
    assert not out.isnan().any()
    # float32 steps per block: d * dx, the FMA, Q4_1's m term; the sum's rounding over k // 32 blocks
    bound = (k // 32 + 4) * 2.0**-23 * magnitude(x, blocks, qtype) + 1e-30
    err = (out.double() - expected).abs()
    assert (err <= bound).all(), (err / bound).max().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_rounding_is_exact(backend):
    """One-hot Q8_0 weights with d = 1 read the rounded activations back: xq = round half to even of x *
    127 / max|x| per block (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2), dx = max|x| / 127, and a block's
    rounding does not see the next block's values."""
    k = 64
    x = torch.zeros(2, k)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -126.5])
    x[0, 32:36] = torch.tensor([-3.0, 1.0, 0.75, 0.0])  # its own block: dx = 3 / 127
    x[1, 40] = 1e-30  # a tiny block alone
    blocks = torch.zeros(k, k // 32, 34, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for j in range(k):
        blocks[j, j // 32, 0:2] = one
        blocks[j, j // 32, 2 + j % 32] = 1
    w_packed = ops.pack_gguf_a8_weight(blocks.reshape(k, -1), 8)
    out = run(x, w_packed, 8, k, backend)
    assert out[0, :6].tolist() == [127.0, 0.0, 2.0, 2.0, -2.0, -126.0]
    dx = np.float32(3.0) / np.float32(127.0)
    xq = [round(float(np.float32(v) * (np.float32(127.0) / np.float32(3.0)))) for v in (-3.0, 1.0, 0.75)]
    assert xq == [-127, 42, 32]
    want = [float(np.float32(np.float32(1.0) * dx) * np.float32(q)) for q in xq]  # d * dx, then times xq
    assert out[0, 32:35].tolist() == pytest.approx(want, rel=2**-23) and out[0, 35] == 0
    assert out[1, 40].item() == pytest.approx(1e-30, rel=2**-22)
    assert (out[1, :40] == 0).all() and (out[1, 41:] == 0).all()


@native
@pytest.mark.parametrize("qtype", QTYPES)
def test_same_bits_on_every_isa_thread_count_and_batch_position(qtype, gen):
    """Every variant does the same float steps in the same order: the bits do not depend on the ISA, the
    threads or the rows around a row (the same as the row alone)."""
    n, k = 200, 576
    w_packed = ops.pack_gguf_a8_weight(random_blocks(n, k, qtype, gen), qtype)
    x = torch.randn(23, k, generator=gen)
    alone = torch.cat([run(x[i : i + 1], w_packed, qtype, n, "native") for i in range(23)])
    before = torch.get_num_threads()
    try:
        for isa in CPU_ISAS:
            with ops.use_cpu_isa(isa):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for m0, m1 in ((0, 1), (3, 5), (0, 4), (5, 12), (7, 22), (0, 23)):
                        got = run(x[m0:m1], w_packed, qtype, n, "native")
                        assert torch.equal(got, alone[m0:m1]), (isa, threads, m0, m1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_non_finite_and_zero_blocks(backend, qtype, gen):
    """A row with inf or NaN in any block gives NaN in every output of that row (never a finite guess);
    an all-zero row gives zeros; the other rows are untouched."""
    n, k = 40, 96
    w_packed = ops.pack_gguf_a8_weight(random_blocks(n, k, qtype, gen), qtype)
    x = torch.randn(4, k, generator=gen)
    x[1, 70] = float("inf")
    x[2, 5] = float("nan")
    x[3] = 0.0
    out = run(x, w_packed, qtype, n, backend)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert (out[3] == 0).all()
    torch.testing.assert_close(out[0], run(x[:1], w_packed, qtype, n, "torch")[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_close_to_the_float32_weights(backend, qtype, gen):
    """The trade: 8-bit activations per block of 32 keep the product within ~1 % of gguf_linear's float32
    result on Gaussian activations (the rounding is half a step of max|x| / 127 per value)."""
    n, k = 96, 576
    blocks = random_blocks(n, k, qtype, gen)
    x = torch.randn(8, k, generator=gen)
    exact = torch.empty(8, n, dtype=torch.float64)
    reference.gguf_linear(x, ops.pack_gguf_weight(blocks, qtype), qtype, exact)
    out = run(x, ops.pack_gguf_a8_weight(blocks, qtype), qtype, n, backend)
    rel = (out.double() - exact).norm() / exact.norm()
    assert rel < 0.01, rel.item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [3, 20])
def test_strided_rows(backend, m, gen):
    """x may be a column slice of a wider activation (e.g. the gate half of gate_up)."""
    wide = torch.randn(m, 2 * 128, generator=gen)
    x = wide[:, 128:]
    assert x.stride(0) == 256 and not x.is_contiguous()
    w_packed = ops.pack_gguf_a8_weight(random_blocks(40, 128, 3, gen), 3)
    assert torch.equal(run(x, w_packed, 3, 40, backend), run(x.contiguous(), w_packed, 3, 40, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend, gen):
    w_packed = ops.pack_gguf_a8_weight(random_blocks(8, 64, 2, gen), 2)
    out = torch.empty(0, 8)
    ops.call_op("gguf_a8_linear", (torch.empty(0, 64), w_packed, 2, out), backend)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_round_trip(qtype, gen):
    size = reference.GGUF_BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (37, 4 * size), generator=gen, dtype=torch.uint8)
    w_packed = ops.pack_gguf_a8_weight(blocks, qtype)
    assert w_packed.shape == (3, 4, 4 * size) and w_packed.dtype == torch.int32
    assert torch.equal(reference.unpack_gguf_a8_weight(w_packed, qtype, 37), blocks)
    assert (reference.unpack_gguf_a8_weight(w_packed, qtype, 48)[37:] == 0).all()  # zero blocks past N
    w8 = w_packed.view(torch.uint8)  # [3, 4, 16 x size]
    # row 21 = panel 1, lane 5: its d is bytes 10..11 of each panel-block, its quant bytes 4g..4g+3 are lane 5
    # of group g
    assert torch.equal(w8[1, 2, 10:12], blocks[21, 2 * size : 2 * size + 2])
    head = 4 if qtype == 3 else 2
    quants = w8[1, 2, 16 * head :].reshape(-1, 16, 4)[:, 5].reshape(-1)
    assert torch.equal(quants, blocks[21, 2 * size + head : 3 * size])
    with pytest.raises(ValueError, match="pack_gguf_a8_weight"):
        ops.pack_gguf_a8_weight(blocks[:, :-1], qtype)
    with pytest.raises(ValueError, match="pack_gguf_a8_weight"):
        ops.pack_gguf_a8_weight(blocks, 12)  # Q4_K: not a format gguf_a8_linear runs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("k_not_32", ValueError, "multiple of 32"),
        ("qtype", ValueError, "not a supported block format"),
        ("x_dtype", TypeError, "dtype"),
        ("x_double", TypeError, "dtype"),
        ("w_uint8_layout", TypeError, "pack_gguf_a8_weight"),
        ("w_dims", ValueError, "dims"),
        ("k_mismatch", ValueError, "w_packed has shape"),
        ("wrong_format", ValueError, "w_packed has shape"),
        ("panels", ValueError, "w_packed has shape"),
        ("out_rows", ValueError, "shape"),
        ("x_cols_strided", ValueError, "contiguous rows"),
        ("out_overlaps_x", ValueError, "overlaps"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x = torch.randn(3, 64, generator=gen)
    qtype = 3
    blocks = random_blocks(20, 64, qtype, gen)
    w_packed = ops.pack_gguf_a8_weight(blocks, qtype)  # 2 panels
    out = torch.empty(3, 20)
    if case == "k_not_32":
        x = torch.randn(3, 48, generator=gen)
    elif case == "qtype":
        qtype = 12
    elif case == "x_dtype":
        x = x.half()
    elif case == "x_double":
        x = x.double()
    elif case == "w_uint8_layout":  # gguf_linear's layout, the same bytes: must not be read as this one
        w_packed = ops.pack_gguf_weight(blocks, qtype)
    elif case == "w_dims":
        w_packed = w_packed.reshape(2, -1)
    elif case == "k_mismatch":
        x = torch.randn(3, 96, generator=gen)
    elif case == "wrong_format":
        qtype = 8
    elif case == "panels":
        out = torch.empty(3, 40)
    elif case == "out_rows":
        out = torch.empty(4, 20)
    elif case == "x_cols_strided":
        x = torch.randn(64, 3, generator=gen).T
    elif case == "out_overlaps_x":
        buf = torch.randn(3 * 64 + 40, generator=gen)
        x, out = buf[: 3 * 64].view(3, 64), buf[100:160].view(3, 20)
    with pytest.raises(exc, match=words):
        ops.call_op("gguf_a8_linear", (x, w_packed, qtype, out), backend)


def test_triton_backend_is_a_clear_error(gen):
    w_packed = ops.pack_gguf_a8_weight(random_blocks(8, 64, 8, gen), 8)
    with pytest.raises(ValueError, match="no triton kernel"):
        ops.call_op("gguf_a8_linear", (torch.randn(2, 64), w_packed, 8, torch.empty(2, 8)), "triton")
