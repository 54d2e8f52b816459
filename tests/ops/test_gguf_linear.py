"""gguf_linear: weights kept in a GGUF file's own blocks (Q4_0, Q4_1, Q8_0; repacked in 16-row
panels), dequantized to float32 as they are read, against the float64 reference of the exactly
dequantized blocks, on every ISA variant the machine runs; the bits equal packed_linear's on the
dequantized weight (what the float32 model computes) at every row count, ISA and thread count;
poisoned outputs, odd row counts, strided rows; the reference's dequantization against gguf's own
(quantize -> dequantize round trip per format) and the packing round trip; the op's input checks."""

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
gguf_dequantize, gguf_quantize = gguf.dequantize, gguf.quantize

# A CPU op (the GGUF blocks for the CPU's bandwidth-bound decode): no CUDA or Triton kernel to test.
BACKENDS = cpu_backends()  # torch, and native once per ISA variant this machine runs
QTYPES = [pytest.param(q, id=name) for name, q in ops.GGUF_QTYPES.items()]


def random_blocks(n, k, qtype, gen):
    """gguf's own quantization of a random weight (rows of different scales, some of them
    one-signed so Q4_1's m is not always negative): uint8 blocks [n, k / 32 * block bytes]."""
    w = torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) * 0.1 + 0.01)
    w[::3] = w[::3].abs()
    blocks = gguf_quantize(w.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(n, -1)


def run(x, w_packed, qtype, n, backend):
    out = poison(torch.empty(x.shape[0], n))
    ops.call_op("gguf_linear", (x, w_packed, qtype, out), backend)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 15, 16, 17, 33])
# n: one partial panel, a partial 2nd, 6 panels (qkv-like), 12.5 panels; K: 1 block, 2, 18 (576), 48 (1536)
@pytest.mark.parametrize("n,k", [(1, 32), (9, 64), (96, 576), (200, 1536)])
def test_matches_reference(backend, qtype, m, n, k, gen):
    x = torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 10 + 0.1)
    w_packed = ops.pack_gguf_weight(random_blocks(n, k, qtype, gen), qtype)
    expected = torch.empty(m, n, dtype=torch.float64)
    reference.gguf_linear(x, w_packed, qtype, expected)
    out = run(x, w_packed, qtype, n, backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(200, 576), (40, 1536)])
def test_bits_equal_packed_linear_on_the_dequantized_weight(qtype, n, k, gen):
    """The float32 model is the file dequantized by gguf and run through packed_linear: gguf_linear on
    the blocks gives its bits at every row count (in-register and dequantize-first paths), every ISA
    variant, and whatever rows surround a row."""
    blocks = random_blocks(n, k, qtype, gen)
    w32 = torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType(qtype))).reshape(n, k)
    w_fp32 = ops.pack_linear_weight(w32)
    w_packed = ops.pack_gguf_weight(blocks, qtype)
    x = torch.randn(40, k, generator=gen)
    for isa in CPU_ISAS:
        with ops.use_cpu_isa(isa):
            for m0, m1 in ((0, 1), (3, 5), (0, 4), (5, 12), (7, 22), (0, 40)):
                want = ops.packed_linear(x[m0:m1], w_fp32, n)
                assert torch.equal(run(x[m0:m1], w_packed, qtype, n, "native"), want), (isa, m0, m1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_do_not_change_the_bits(backend, gen):
    x = torch.randn(9, 576, generator=gen)
    w_packed = ops.pack_gguf_weight(random_blocks(1536, 576, 3, gen), 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, w_packed, 3, 1536, backend)
        torch.set_num_threads(2)
        two = run(x, w_packed, 3, 1536, backend)
    finally:
        torch.set_num_threads(before)
    assert not one.isnan().any()
    assert torch.equal(one, two)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [3, 20])
def test_strided_rows(backend, m, gen):
    """x may be a column slice of a wider activation (e.g. the gate half of gate_up)."""
    wide = torch.randn(m, 2 * 128, generator=gen)
    x = wide[:, 128:]
    assert x.stride(0) == 256 and not x.is_contiguous()
    w_packed = ops.pack_gguf_weight(random_blocks(40, 128, 8, gen), 8)
    torch.testing.assert_close(
        run(x, w_packed, 8, 40, backend), run(x.contiguous(), w_packed, 8, 40, "torch"), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend, gen):
    w_packed = ops.pack_gguf_weight(random_blocks(8, 64, 2, gen), 2)
    out = torch.empty(0, 8)
    ops.call_op("gguf_linear", (torch.empty(0, 64), w_packed, 2, out), backend)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf(qtype, gen):
    """quantize (gguf) -> dequantize: the reference's float32 dequantization is gguf's, bit for bit; its
    float64 one is exact (within float32 rounding of it); both within the format's step of the weight."""
    n, k = 37, 256
    w = torch.randn(n, k, generator=gen) * 0.05
    w[5] = w[5].abs() + 0.01  # one-signed rows: Q4_1's m > 0
    w[6, :32] = 0.0  # an all-zero block stays zero
    blocks_np = gguf_quantize(w.numpy(), GGMLQuantizationType(qtype))
    blocks = torch.from_numpy(np.ascontiguousarray(blocks_np)).view(torch.uint8).reshape(n, -1)
    theirs = torch.from_numpy(gguf_dequantize(blocks_np, GGMLQuantizationType(qtype))).reshape(n, k)
    ours = reference.dequantize_gguf(blocks, qtype)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    exact = reference.dequantize_gguf(blocks, qtype, torch.float64)
    torch.testing.assert_close(exact, theirs.double(), rtol=2**-23, atol=0)
    assert (ours[6, :32] == 0).all()
    # every value is within one quantization step of the weight: the block's range / levels
    step = w.view(n, k // 32, 32).abs().amax(-1) * (2 / 15 if qtype != 8 else 1 / 127)
    assert ((ours - w).abs().view(n, k // 32, 32) <= step[..., None] * 1.01 + 1e-6).all()


@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_round_trip(qtype, gen):
    size = reference.GGUF_BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (37, 4 * size), generator=gen, dtype=torch.uint8)
    w_packed = ops.pack_gguf_weight(blocks, qtype)
    assert w_packed.shape == (3, 4, 16 * size) and w_packed.dtype == torch.uint8
    assert torch.equal(reference.unpack_gguf_weight(w_packed, qtype, 37), blocks)
    assert (reference.unpack_gguf_weight(w_packed, qtype, 48)[37:] == 0).all()  # zero blocks past N
    # row 21 = panel 1, row 5: its d is bytes 10..11 of each panel-block
    assert torch.equal(w_packed[1, 2, 10:12], blocks[21, 2 * size : 2 * size + 2])
    with pytest.raises(ValueError, match="pack_gguf_weight"):
        ops.pack_gguf_weight(blocks[:, :-1], qtype)
    with pytest.raises(ValueError, match="pack_gguf_weight"):
        ops.pack_gguf_weight(blocks, 12)  # Q4_K: not a format gguf_linear runs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("k_not_32", ValueError, "multiple of 32"),
        ("qtype", ValueError, "not a supported block format"),
        ("x_dtype", TypeError, "dtype"),
        ("w_dtype", TypeError, "dtype"),
        ("w_dims", ValueError, "dims"),
        ("k_mismatch", ValueError, "w_packed has shape"),
        ("wrong_format", ValueError, "w_packed has shape"),
        ("panels", ValueError, "w_packed has shape"),
        ("out_rows", ValueError, "shape"),
        ("x_cols_strided", ValueError, "contiguous rows"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x = torch.randn(3, 64, generator=gen)
    qtype = 3
    w_packed = ops.pack_gguf_weight(random_blocks(20, 64, qtype, gen), qtype)  # 2 panels
    out = torch.empty(3, 20)
    if case == "k_not_32":
        x = torch.randn(3, 48, generator=gen)
    elif case == "qtype":
        qtype = 12
    elif case == "x_dtype":
        x = x.half()
    elif case == "w_dtype":
        w_packed = w_packed.to(torch.int16)
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
    with pytest.raises(exc, match=words):
        ops.call_op("gguf_linear", (x, w_packed, qtype, out), backend)


def test_triton_backend_is_a_clear_error(gen):
    w_packed = ops.pack_gguf_weight(random_blocks(8, 64, 8, gen), 8)
    with pytest.raises(ValueError, match="no triton kernel"):
        ops.call_op("gguf_linear", (torch.randn(2, 64), w_packed, 8, torch.empty(2, 8)), "triton")
