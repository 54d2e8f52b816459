"""Bad input gets a clear error, on every backend: the same exception type and key words."""

import pytest
import torch

from helpers.paged_kv import make_paged_kv
from helpers.targets import targets
from minisched import ops

# the checks run before any kernel; every CPU backend must reject the same inputs
TARGETS = [p for p in targets("paged_decode_attention") if p.values[0].dtype == torch.float32]


@pytest.fixture
def case(gen):
    kv = make_paged_kv([5, 20], 16, 2, 64, torch.float32, "cpu", gen=gen)
    q = torch.randn(2, 4, 64, generator=gen)
    return q, kv


def decode(t, q, kv, indptr=None, indices=None, last=None, k_cache=None, v_cache=None, out=None):
    out = torch.empty_like(q) if out is None else out
    args = (
        q,
        kv.k_cache if k_cache is None else k_cache,
        kv.v_cache if v_cache is None else v_cache,
        kv.kv_indptr if indptr is None else indptr,
        kv.kv_indices if indices is None else indices,
        kv.kv_last_page_len if last is None else last,
        0.125,
        out,
        None,
    )
    ops.call_op("paged_decode_attention", args, t.backend)


@pytest.mark.parametrize("t", TARGETS)
def test_wrong_dtype(t, case):
    q, kv = case
    with pytest.raises(TypeError, match="dtype"):
        decode(t, q.half(), kv, out=torch.empty_like(q.half()))
    with pytest.raises(TypeError, match="dtype"):
        decode(t, q, kv, indptr=kv.kv_indptr.long())


@pytest.mark.parametrize("t", TARGETS)
def test_wrong_shape(t, case):
    q, kv = case
    with pytest.raises(ValueError, match="shape"):
        decode(t, q[:, :, :32].contiguous(), kv, out=torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="shape"):
        decode(t, torch.randn(2, 3, 64), kv, out=torch.empty(2, 3, 64))  # 3 q heads over 2 kv heads
    with pytest.raises(ValueError, match="shape"):
        decode(t, q, kv, last=kv.kv_last_page_len[:1])


@pytest.mark.parametrize("t", TARGETS)
def test_wrong_device(t, case):
    q, kv = case
    with pytest.raises(ValueError, match="device"):
        decode(t, q, kv, out=torch.empty(q.shape, device="meta"))


@pytest.mark.parametrize("t", TARGETS)
def test_not_contiguous(t, case):
    q, kv = case
    q_t = torch.randn(4, 2, 64).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        decode(t, q_t, kv)


@pytest.mark.parametrize("t", TARGETS)
def test_page_size_mismatch(t, case):
    q, kv = case
    v8 = torch.randn(kv.v_cache.shape[0] * 2, 8, 2, 64)
    with pytest.raises(ValueError, match="page_size"):
        decode(t, q, kv, v_cache=v8)
    pool = torch.randn(2, 2, 6, 16, 2, 64)
    with pytest.raises(ValueError, match="page_size"):
        ops.gather_kv_pages(
            pool, torch.tensor([1], dtype=torch.int32), torch.empty(2, 2, 1, 8, 2, 64), backend=t.backend
        )


@pytest.mark.parametrize("t", TARGETS)
def test_page_index_out_of_range(t, case):
    q, kv = case
    bad = kv.kv_indices.clone()
    bad[-1] = kv.k_cache.shape[0]
    with pytest.raises(IndexError, match="out of range"):
        decode(t, q, kv, indices=bad)
    bad[-1] = -1
    with pytest.raises(IndexError, match="out of range"):
        decode(t, q, kv, indices=bad)
    pool = torch.randn(2, 2, 6, 16, 2, 64)
    with pytest.raises(IndexError, match="out of range"):
        ops.copy_kv_pages(
            pool, torch.tensor([0], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), backend=t.backend
        )
    with pytest.raises(IndexError, match="out of range"):
        ops.scatter_kv_pages(
            torch.randn(2, 2, 1, 16, 2, 64), pool, torch.tensor([-2], dtype=torch.int32), backend=t.backend
        )


@pytest.mark.parametrize("t", TARGETS)
def test_slot_out_of_range(t, gen):
    k_cache, v_cache = torch.randn(3, 16, 2, 64), torch.randn(3, 16, 2, 64)
    k = v = torch.randn(2, 2, 64)
    before = k_cache.clone()
    with pytest.raises(IndexError, match="out of range"):
        ops.store_kv(k, v, k_cache, v_cache, torch.tensor([0, 48], dtype=torch.int32), backend=t.backend)
    assert torch.equal(k_cache, before), "a rejected call must not write anything"


@pytest.mark.parametrize("t", TARGETS)
def test_last_page_len_out_of_range(t, case):
    q, kv = case
    for bad_value in (0, 17):
        bad = kv.kv_last_page_len.clone()
        bad[0] = bad_value
        with pytest.raises(ValueError, match="last_page_len"):
            decode(t, q, kv, last=bad)


@pytest.mark.parametrize("t", TARGETS)
def test_bad_indptr(t, case):
    q, kv = case
    bad = kv.kv_indptr.clone()
    bad[1] = bad[2] + 1  # decreasing
    with pytest.raises(ValueError, match="indptr"):
        decode(t, q, kv, indptr=bad)


@pytest.mark.parametrize("t", TARGETS)
def test_qo_len_longer_than_kv_len(t, case):
    q, kv = case  # kv_lens 5 and 20
    q6 = torch.randn(7, 4, 64)
    qo = torch.tensor([0, 6, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="qo_len"):
        ops.paged_prefill_attention(q6, qo, kv.k_cache, kv.v_cache, *kv.table, backend=t.backend)


@pytest.mark.parametrize("t", TARGETS)
def test_copy_pages_overlap(t):
    """Copies run in parallel, so a chain (1->2, 2->3) or a repeated destination is rejected."""
    pool = torch.randn(1, 2, 6, 4, 2, 64)
    before = pool.clone()
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="disjoint"):
        ops.copy_kv_pages(pool, i32([1, 2]), i32([2, 3]), backend=t.backend)
    with pytest.raises(ValueError, match="distinct"):
        ops.copy_kv_pages(pool, i32([0, 1]), i32([4, 4]), backend=t.backend)
    assert torch.equal(pool, before)


# -- paged_prefill_attention's kernel choice (cuda_kernel= / the schema's trailing `kernel`) ------------------
PREFILL_TARGETS = [p for p in targets("paged_prefill_attention") if p.values[0].dtype == torch.float32]


def prefill_case(gen):
    kv = make_paged_kv([5, 20], 16, 2, 64, torch.float32, "cpu", gen=gen)
    qo_indptr = torch.tensor([0, 3, 10], dtype=torch.int32)
    return torch.randn(10, 4, 64, generator=gen), qo_indptr, kv


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_prefill_cuda_kernel_names(backend, gen):
    """A bad name is a one-line ValueError; "mma" / "wgmma" name kernels of the native CUDA backend, so they are
    a ValueError on the CPU (and on other backends) before anything runs; "auto" is the default everywhere."""
    if backend == "native" and not ops.native_available():
        pytest.skip(ops.NATIVE_ERROR)
    q, qo_indptr, kv = prefill_case(gen)
    call = lambda name: ops.paged_prefill_attention(
        q,
        qo_indptr,
        kv.k_cache,
        kv.v_cache,
        *kv.table,  # noqa: E731
        backend=backend,
        cuda_kernel=name,
    )
    for bad in ("fa3", "WGMMA", "", None, 2):
        with pytest.raises(ValueError, match=r"cuda_kernel must be one of \('auto', 'mma', 'wgmma'\)") as e:
            call(bad)
        assert "\n" not in str(e.value)
    for name in ("mma", "wgmma"):
        with pytest.raises(ValueError, match="native CUDA backend") as e:
            call(name)
        assert "\n" not in str(e.value)
    torch.testing.assert_close(
        call("auto"), ops.paged_prefill_attention(q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, backend=backend)
    )


@pytest.mark.parametrize("t", PREFILL_TARGETS)
def test_prefill_kernel_argument(t, gen):
    """The op's trailing `kernel` argument: 0, 1, 2 accepted (a CUDA choice: the CPU, Triton and the reference
    ignore it, same result), anything else a ValueError on every backend; omitting it is kernel 0."""
    q, qo_indptr, kv = prefill_case(gen)
    outs = []
    for kernel in (None, 0, 1, 2):
        out = torch.empty_like(q)
        extra = () if kernel is None else (kernel,)
        ops.call_op(
            "paged_prefill_attention",
            (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, True, 0.125, out, None, *extra),
            t.backend,
        )
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="kernel must be 0 \\(auto\\), 1 \\(mma.sync\\) or 2 \\(wgmma\\)"):
            ops.call_op(
                "paged_prefill_attention",
                (q, qo_indptr, kv.k_cache, kv.v_cache, *kv.table, True, 0.125, torch.empty_like(q), None, bad),
                t.backend,
            )
