"""int8_linear: int8 weights (16-column panels, input channels in pairs) times rows quantized to int16
on the fly, summed in int32 (vpmaddwd / vpdpwssd), against the float64 reference of the same
quantization, on every ISA variant the machine runs; the variants and batch sizes agree bit for bit;
poisoned outputs, strided rows, rows of zeros, groups longer than one int32 sum (256 channels), edge
cases; quantize_int8's error bound and the packing round trip; the op's input checks."""

import pytest
import torch

from helpers import amx_emulation
from helpers.targets import CPU_ISAS, cpu_backends, poison
from minisched import ops
from minisched.ops import reference

# A CPU op (int8 weights for the CPU's bandwidth-bound decode and compute-bound prefill): no CUDA or
# Triton kernel to test; asking the triton backend for it is a clear error (test_triton_backend_is_a_clear_error).
BACKENDS = cpu_backends()  # torch, and native once per ISA variant this machine runs


def random_weights(n, k, group, gen):
    """Random int8 values over the whole range and positive scales that differ per group, packed."""
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    return ops.pack_int8_weight(w_q, scales)


def run(x, w_packed, s_packed, n, backend):
    out = poison(torch.empty(x.shape[0], n))
    ops.call_op("int8_linear", (x, w_packed, s_packed, out), backend)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 15, 16, 17, 64])
# n: one partial panel, a partial 2nd, 6 panels, 12.5 (partial last of a 3- and 8-panel call);
# groups: 32, 64, one per row (576: 3 int32 sums of 256, 256, 64), 1536 (6 sums)
@pytest.mark.parametrize(
    "n,k,group", [(1, 32, 32), (9, 64, 32), (96, 576, 64), (200, 1536, 64), (33, 576, 576), (20, 1536, 1536)]
)
def test_matches_reference(backend, m, n, k, group, gen):
    x = torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 10 + 0.1)  # rows of different scales
    w_packed, s_packed = random_weights(n, k, group, gen)
    expected = torch.empty(m, n, dtype=torch.float64)
    reference.int8_linear(x, w_packed, s_packed, expected)
    out = run(x, w_packed, s_packed, n, backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_reference_is_the_exact_integer_sum(gen):
    """The oracle itself: int16 rows and int8 weights summed exactly, per group, then scaled."""
    x = torch.randn(3, 64, generator=gen)
    w_q = torch.randint(-127, 128, (5, 64), generator=gen, dtype=torch.int8)
    scales = torch.rand(5, 2, generator=gen) + 0.5
    q, sx = reference.quantize_rows_int16(x)
    assert q.dtype == torch.int16 and q.abs().max(dim=1).values.eq(32767).all()
    assert torch.allclose(q.double() * sx.double()[:, None], x.double(), atol=float(sx.max()) / 2 + 1e-12)
    sums = (q.long()[:, None, :] * w_q.long()[None, :, :]).view(3, 5, 2, 32).sum(-1).double()  # [M, N, groups]
    want = (sums * scales.double()[None]).sum(-1) * sx.double()[:, None]
    got = torch.empty(3, 5, dtype=torch.float64)
    reference.int8_linear(x, *ops.pack_int8_weight(w_q, scales), got)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))
@pytest.mark.parametrize("n,k,group", [(200, 576, 64), (33, 1536, 1536)])
def test_every_isa_and_batch_gives_the_same_bits(n, k, group, gen):
    """The integer sums are exact and every variant does the same float operations in the same order:
    AVX2 (vpmaddwd), AVX-VNNI and AVX-512 (vpdpwssd) and AMX (tdpbssd + tdpbusd on the int16 rows'
    high and low bytes, from 32 rows on) agree bit for bit, and a row's result does not
    depend on the rows around it (batch invariance: one kernel for every batch size)."""
    x = torch.randn(40, k, generator=gen)
    w_packed, s_packed = random_weights(n, k, group, gen)
    got = {}
    for isa in CPU_ISAS:  # AMX from 32 rows on: whole row tiles and a padded last one (40, 33 rows)
        with ops.use_cpu_isa(isa):
            got[isa] = run(x, w_packed, s_packed, n, "native")
            for m0, m1 in ((0, 1), (5, 7), (3, 11), (10, 18), (0, 16), (0, 23), (7, 40)):
                assert torch.equal(run(x[m0:m1], w_packed, s_packed, n, "native"), got[isa][m0:m1]), (isa, m0, m1)
    for isa in CPU_ISAS[1:]:
        assert torch.equal(got[isa], got[CPU_ISAS[0]]), isa


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_zeros_and_threads(backend, gen):
    """A row of zeros (scale 0) gives zeros, not NaN; the thread count does not change the bits."""
    x = torch.randn(9, 576, generator=gen)
    x[4] = 0
    w_packed, s_packed = random_weights(3072, 576, 64, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x, w_packed, s_packed, 3072, backend)
        torch.set_num_threads(2)
        two = run(x, w_packed, s_packed, 3072, backend)
    finally:
        torch.set_num_threads(before)
    assert (one[4] == 0).all() and not one.isnan().any()
    if backend == "native":
        assert torch.equal(one, two)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [3, 20])
def test_strided_rows(backend, m, gen):
    """x may be a column slice of a wider activation (e.g. the gate half of gate_up)."""
    wide = torch.randn(m, 2 * 128, generator=gen)
    x = wide[:, 128:]
    assert x.stride(0) == 256 and not x.is_contiguous()
    w_packed, s_packed = random_weights(40, 128, 32, gen)
    torch.testing.assert_close(
        run(x, w_packed, s_packed, 40, backend),
        run(x.contiguous(), w_packed, s_packed, 40, "torch"),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend, gen):
    w_packed, s_packed = random_weights(8, 64, 32, gen)
    out = torch.empty(0, 8)
    ops.call_op("int8_linear", (torch.empty(0, 64), w_packed, s_packed, out), backend)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapper_end_to_end(backend, gen):
    """quantize -> pack -> int8_linear stays within the quantization error of the fp32 matmul."""
    w = torch.randn(300, 576, generator=gen) * 0.05
    x = torch.randn(6, 576, generator=gen)
    w_q, scales = ops.quantize_int8(w, group_size=64)
    got = ops.int8_linear(x, *ops.pack_int8_weight(w_q, scales), 300, backend=backend)
    exact = x @ w.T
    # each weight is off by at most scale/2; the error of a dot product grows like sqrt(K)
    err = (got - exact).abs().max().item()
    assert 0 < err < 0.05 * exact.abs().max().item()


def test_quantize_int8_round_trip(gen):
    w = torch.randn(37, 256, generator=gen)
    w[3, :64] = 0.0  # an all-zero group stays zero
    w_q, scales = ops.quantize_int8(w, group_size=64)
    assert w_q.dtype == torch.int8 and scales.shape == (37, 4)
    assert w_q.abs().max() == 127 and (scales[3, 0] == 0) and (w_q[3, :64] == 0).all()
    back = reference.dequantize_int8(w_q, scales)
    bound = scales.repeat_interleave(64, dim=1) / 2 + 1e-7
    assert ((back - w).abs() <= bound).all()
    w_packed, s_packed = ops.pack_int8_weight(w_q, scales)
    assert w_packed.shape == (3, 128, 32) and s_packed.shape == (3, 4, 16)
    assert w_packed[1, 7, 2 * 5 + 1] == w_q[21, 15] and s_packed[2, 1, 4] == scales[36, 1]
    assert (w_packed[2, :, 2 * 5 :] == 0).all() and (s_packed[2, :, 5:] == 0).all()  # zero past N
    unpacked = reference.unpack_int8_weight(w_packed, s_packed, 37)
    assert torch.equal(unpacked[0], w_q) and torch.equal(unpacked[1], scales)
    with pytest.raises(ValueError, match="pack_int8_weight"):
        ops.pack_int8_weight(w_q[:, :48], scales)


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
        ("w_dims", ValueError, "dims"),
        ("k_mismatch", ValueError, "w_packed has shape"),
        ("panels", ValueError, "w_packed has shape"),
        ("bad_group", ValueError, "multiple of 32"),
        ("s_panels", ValueError, "s_packed has shape"),
        ("out_rows", ValueError, "shape"),
        ("x_cols_strided", ValueError, "contiguous rows"),
    ],
)
def test_bad_input(backend, case, exc, words, gen):
    x = torch.randn(3, 64, generator=gen)
    w_packed, s_packed = random_weights(20, 64, 32, gen)  # 2 panels
    out = torch.empty(3, 20)
    if case == "x_dtype":
        x = x.half()
    elif case == "w_dtype":
        w_packed = w_packed.to(torch.int16)
    elif case == "w_dims":
        w_packed = w_packed.reshape(2, -1)
    elif case == "k_mismatch":
        x = torch.randn(3, 96, generator=gen)
    elif case == "panels":
        out = torch.empty(3, 40)  # 3 panels needed
    elif case == "bad_group":
        s_packed = torch.rand(2, 4, 16, generator=gen)  # group 16
    elif case == "s_panels":
        s_packed = torch.rand(1, 2, 16, generator=gen)
    elif case == "out_rows":
        out = torch.empty(4, 20)
    elif case == "x_cols_strided":
        x = torch.randn(64, 3, generator=gen).T
    with pytest.raises(exc, match=words):
        ops.call_op("int8_linear", (x, w_packed, s_packed, out), backend)


def test_triton_backend_is_a_clear_error(gen):
    w_packed, s_packed = random_weights(8, 64, 32, gen)
    with pytest.raises(ValueError, match="no triton kernel"):
        ops.call_op("int8_linear", (torch.randn(2, 64), w_packed, s_packed, torch.empty(2, 8)), "triton")


def test_amx_split_and_tiles_give_the_exact_int32_sums(gen):
    """The AMX variant's arithmetic, emulated (so it is checked on machines without AMX too): int16
    rows split into signed high and unsigned low bytes, a panel relaid out into B-tile rows, and the
    two byte dot products combined as 256 hi + lo give exactly the int32 sum of every 256-channel
    block that the vpdpwssd kernels form -- also at the extremes, where the bound says int32 holds."""
    k, n = 576, 32
    x = torch.randn(18, k, generator=gen)
    x[16], x[17] = 1.0, -1.0  # rows quantized to all +32767 and all -32767
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w_q[:16, :256] = -127  # with row 17: the largest |hi sum| a block can reach
    w_packed, _ = ops.pack_int8_weight(w_q, torch.ones(n, k // 64))
    q, _ = reference.quantize_rows_int16(x)
    hi, lo = amx_emulation.int8_split(q)
    assert hi.dtype == torch.int8 and lo.dtype == torch.uint8
    assert torch.equal(hi.long() * 256 + lo.long(), q.long())
    largest = 0
    for p in range(n // 16):
        b = amx_emulation.int8_b_tiles(w_packed[p])
        assert b.shape == (k // 4, 64)
        for c0 in range(0, k, reference.INT32_BLOCK):
            c1 = min(k, c0 + reference.INT32_BLOCK)
            sum_hi = amx_emulation.tile_dot_bytes(hi[:, c0:c1], b[c0 // 4 : c1 // 4])
            sum_lo = amx_emulation.tile_dot_bytes(lo[:, c0:c1], b[c0 // 4 : c1 // 4])
            want = q[:, c0:c1].long() @ w_q[16 * p : 16 * p + 16, c0:c1].long().T
            assert torch.equal(256 * sum_hi + sum_lo, want), (p, c0)
            largest = max(largest, int((256 * sum_hi).abs().max()), int(sum_lo.abs().max()))
    assert largest == 256 * 128 * 127 * 256  # reached, and below 2^31
    assert largest < 2**31


def test_amx_runs_here_or_says_why():
    """Where the CPU has AMX and Linux grants the tiles, the `amx` variant is one of the variants every
    test above runs; where not, this says why (and only the emulation above checks the AMX path)."""
    f = ops.cpu_features()
    if "amx" not in f["supported"]:
        why = f.get("amx_error") or "cpuid lists no AMX-TILE/INT8/BF16 (or no AVX-512 BF16)"
        pytest.skip(f"no AMX variant on this machine: {why}")
    assert f["flags"]["amx_int8"] and f["flags"]["amx_bf16"] and f["flags"]["os_amx"]
    assert "amx" in CPU_ISAS
