"""Input checks for the ops, shared by the `torch` and `triton` backends and the fake kernels.

They mirror csrc/checks.h, which guards the native ops; both raise the same
exception types with the same words so that callers can rely on them:

    TypeError   wrong dtype                       ("dtype")
    ValueError  wrong shape / device / layout     ("shape", "device", "contiguous", "page_size",
                bad page table                     "indptr", "last_page_len", "qo_len")
    IndexError  a page or slot index out of range ("out of range")

`values=False` skips the checks that read index tensors (used on meta tensors
and on GPU tensors whose page tables were validated on the host already).
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from minisched.base.values import cdiv

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _fail(exc: type[Exception], op: str, msg: str) -> None:
    raise exc(f"{op}: {msg}")


def check_dtype(op: str, name: str, t: torch.Tensor, dtypes) -> None:
    if t.dtype not in dtypes:
        _fail(TypeError, op, f"{name} has dtype {t.dtype}, expected one of {tuple(str(d) for d in dtypes)}")


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        _fail(TypeError, op, f"{name} has dtype {t.dtype}, expected {ref.dtype} like {ref_name}")


def check_shape(op: str, name: str, t: torch.Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(ValueError, op, f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_dim(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        _fail(ValueError, op, f"{name} must have {ndim} dims (shape {tuple(t.shape)})")


def check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(ValueError, op, f"{name} must be contiguous")


def check_no_overlap(op: str, out_name: str, out: torch.Tensor, in_name: str, t: torch.Tensor) -> None:
    """out must not share memory with t, an input read while out is written: the byte spans of two views
    of one storage must not intersect (csrc/checks.h check_no_overlap). Tensors without data (fake, meta) pass."""
    if out.numel() == 0 or t.numel() == 0 or out.device.type == "meta" or is_fake(out) or is_fake(t):
        return
    if out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return

    def span(u: torch.Tensor) -> tuple[int, int]:
        first = int(u.storage_offset())
        last = first + sum((int(n) - 1) * st for n, st in zip(u.shape, u.stride()))
        return first * u.element_size(), (last + 1) * u.element_size()

    (a0, a1), (b0, b1) = span(out), span(t)
    if not (a1 <= b0 or b1 <= a0):
        _fail(ValueError, op, f"{out_name} overlaps {in_name} (pass a separate output tensor)")


def check_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        _fail(ValueError, op, f"{name} is on device {t.device}, expected {device}")


def check_index(op: str, name: str, t: torch.Tensor, device: torch.device, ndim: int = 1) -> None:
    check_dtype(op, name, t, (torch.int32,))
    check_dim(op, name, t, ndim)
    check_contiguous(op, name, t)
    check_device(op, name, t, device)


def check_cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One layer's K and V caches: [num_pages, page_size, Hkv, D], same dtype/shape/device."""
    check_dtype(op, "k_cache", k_cache, FLOAT_DTYPES)
    check_dim(op, "k_cache", k_cache, 4)
    check_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    if v_cache.shape != k_cache.shape:
        _fail(
            ValueError,
            op,
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)} "
            "(num_pages, page_size, Hkv, D must match)",
        )
    check_device(op, "v_cache", v_cache, k_cache.device)
    check_contiguous(op, "k_cache", k_cache)
    check_contiguous(op, "v_cache", v_cache)


def check_range(op: str, name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    """Every value of t in [lo, hi)."""
    if t.numel() == 0:
        return
    mn, mx = int(t.min()), int(t.max())
    if mn < lo or mx >= hi:
        bad = mn if mn < lo else mx
        _fail(IndexError, op, f"{name} value {bad} out of range [{lo}, {hi})")


def check_page_table(
    op: str,
    prefix: str,
    indptr,
    indices,
    last,
    batch: int,
    num_pages: int,
    page_size: int,
    device: torch.device,
    values: bool,
) -> None:
    """CSR page table of `batch` requests over a pool of num_pages pages of page_size tokens."""
    check_index(op, f"{prefix}kv_indptr", indptr, device)
    check_index(op, f"{prefix}kv_indices", indices, device)
    check_index(op, f"{prefix}kv_last_page_len", last, device)
    check_shape(op, f"{prefix}kv_indptr", indptr, (batch + 1,))
    check_shape(op, f"{prefix}kv_last_page_len", last, (batch,))
    if not values:
        return
    ip = indptr.cpu()
    if int(ip[0]) != 0 or bool((ip[1:] < ip[:-1]).any()) or int(ip[-1]) != indices.shape[0]:
        _fail(
            ValueError,
            op,
            f"{prefix}kv_indptr must start at 0, be non-decreasing and end at "
            f"len(kv_indices)={indices.shape[0]}; got {ip.tolist()[:8]}...",
        )
    if last.numel() and (int(last.min()) < 1 or int(last.max()) > page_size):
        _fail(ValueError, op, f"{prefix}kv_last_page_len must be in 1..page_size={page_size}")
    check_range(op, f"{prefix}kv_indices", indices, 0, num_pages)


def kv_lens(indptr: torch.Tensor, last: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length per request; a request with no pages is an empty range (length 0)."""
    npages = (indptr[1:] - indptr[:-1]).long()
    return torch.where(npages > 0, (npages - 1) * page_size + last.long(), 0)


def check_query(op: str, q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor) -> None:
    """q [N, Hq, D] against caches [.., Hkv, D]: same dtype/device, Hq % Hkv == 0; out like q."""
    check_dim(op, "q", q, 3)
    check_same_dtype(op, "q", q, "k_cache", k_cache)
    check_device(op, "q", q, k_cache.device)
    check_contiguous(op, "q", q)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != d:
        _fail(ValueError, op, f"q head_dim {q.shape[2]} != cache head_dim {d} (shape mismatch)")
    if q.shape[1] % hkv != 0:
        _fail(ValueError, op, f"q heads {q.shape[1]} not a multiple of kv heads {hkv} (shape mismatch)")
    check_shape(op, "out", out, q.shape)
    check_same_dtype(op, "out", out, "q", q)
    check_device(op, "out", out, q.device)
    check_contiguous(op, "out", out)


def check_lse(op: str, lse, q: torch.Tensor) -> None:
    if lse is None:
        return
    check_dtype(op, "lse", lse, (torch.float32,))
    check_shape(op, "lse", lse, q.shape[:2])
    check_device(op, "lse", lse, q.device)
    check_contiguous(op, "lse", lse)


# -- one function per op: the same argument list as the op ------------------------------------


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, values: bool = True) -> None:
    op = "store_kv"
    check_cache_pair(op, k_cache, v_cache)
    num_pages, page_size, hkv, d = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        check_same_dtype(op, name, t, "k_cache", k_cache)
        check_device(op, name, t, k_cache.device)
        check_dim(op, name, t, 3)
        check_shape(op, name, t, (k.shape[0], hkv, d))
    check_index(op, "slot_mapping", slot_mapping, k_cache.device)
    check_shape(op, "slot_mapping", slot_mapping, (k.shape[0],))
    if values and slot_mapping.numel():
        mx = int(slot_mapping.max())
        if mx >= num_pages * page_size:
            _fail(IndexError, op, f"slot_mapping value {mx} out of range [0, {num_pages * page_size})")


def _check_pool(op: str, kv_cache) -> None:
    check_dtype(op, "kv_cache", kv_cache, FLOAT_DTYPES)
    check_dim(op, "kv_cache", kv_cache, 6)
    check_contiguous(op, "kv_cache", kv_cache)
    if kv_cache.shape[1] != 2:
        _fail(ValueError, op, f"kv_cache shape {tuple(kv_cache.shape)} must be [L, 2, num_pages, page_size, Hkv, D]")


def copy_kv_pages(kv_cache, src_pages, dst_pages, *, values: bool = True) -> None:
    op = "copy_kv_pages"
    _check_pool(op, kv_cache)
    check_index(op, "src_pages", src_pages, kv_cache.device)
    check_index(op, "dst_pages", dst_pages, kv_cache.device)
    check_shape(op, "dst_pages", dst_pages, src_pages.shape)
    if values:
        check_range(op, "src_pages", src_pages, 0, kv_cache.shape[2])
        check_range(op, "dst_pages", dst_pages, 0, kv_cache.shape[2])
        # copies run in parallel on every backend: no page may be written twice or both read and written
        dst = dst_pages.tolist()
        if len(set(dst)) != len(dst):
            _fail(ValueError, op, "dst_pages must be distinct")
        if set(dst) & set(src_pages.tolist()):
            _fail(ValueError, op, "src_pages and dst_pages must be disjoint")


def _check_buffer(op: str, name: str, buf, kv_cache, pages) -> None:
    """A page buffer [L, 2, n, page_size, Hkv, D] on any device, same dtype as the pool."""
    check_same_dtype(op, name, buf, "kv_cache", kv_cache)
    check_contiguous(op, name, buf)
    expect = (*kv_cache.shape[:2], pages.shape[0], *kv_cache.shape[3:])
    if buf.dim() == 6 and buf.shape[3] != kv_cache.shape[3]:
        _fail(ValueError, op, f"{name} page_size {buf.shape[3]} != kv_cache page_size {kv_cache.shape[3]}")
    check_shape(op, name, buf, expect)


def gather_kv_pages(kv_cache, pages, out, *, values: bool = True) -> None:
    op = "gather_kv_pages"
    _check_pool(op, kv_cache)
    check_index(op, "pages", pages, kv_cache.device)
    _check_buffer(op, "out", out, kv_cache, pages)
    if values:
        check_range(op, "pages", pages, 0, kv_cache.shape[2])


def scatter_kv_pages(src, kv_cache, pages, *, values: bool = True) -> None:
    op = "scatter_kv_pages"
    _check_pool(op, kv_cache)
    check_index(op, "pages", pages, kv_cache.device)
    _check_buffer(op, "src", src, kv_cache, pages)
    if values:
        check_range(op, "pages", pages, 0, kv_cache.shape[2])


def paged_decode_attention(
    q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out, lse=None, *, values: bool = True
) -> None:
    op = "paged_decode_attention"
    check_cache_pair(op, k_cache, v_cache)
    check_query(op, q, k_cache, out)
    check_lse(op, lse, q)
    check_page_table(
        op,
        "",
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        q.shape[0],
        k_cache.shape[0],
        k_cache.shape[1],
        q.device,
        values,
    )


# paged_prefill_attention's `kernel` schema argument (CUDA only): the Python wrapper's cuda_kernel names
PREFILL_KERNELS = {"auto": 0, "mma": 1, "wgmma": 2}


def paged_prefill_attention(
    q,
    qo_indptr,
    k_cache,
    v_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    causal,
    sm_scale,
    out,
    lse=None,
    kernel: int = 0,
    *,
    values: bool = True,
) -> None:
    op = "paged_prefill_attention"
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel not in PREFILL_KERNELS.values():
        _fail(ValueError, op, f"kernel must be 0 (auto), 1 (mma.sync) or 2 (wgmma), got {kernel!r}")
    check_cache_pair(op, k_cache, v_cache)
    check_query(op, q, k_cache, out)
    check_lse(op, lse, q)
    check_index(op, "qo_indptr", qo_indptr, q.device)
    batch = qo_indptr.shape[0] - 1
    if batch < 0:
        _fail(ValueError, op, "qo_indptr must have shape [B+1] (got an empty tensor)")
    check_page_table(
        op, "", kv_indptr, kv_indices, kv_last_page_len, batch, k_cache.shape[0], k_cache.shape[1], q.device, values
    )
    if values:
        _check_qo(op, "qo_indptr", qo_indptr, q.shape[0])
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).cpu().long()
        lens = kv_lens(kv_indptr.cpu(), kv_last_page_len.cpu(), k_cache.shape[1])
        if bool((qo_lens > lens).any()):
            b = int((qo_lens > lens).nonzero()[0])
            _fail(ValueError, op, f"request {b}: qo_len {int(qo_lens[b])} > kv_len {int(lens[b])}")


def prefill_cuda_kernel(q: torch.Tensor, cuda_kernel: str, backend: str) -> int:
    """The `kernel` argument for cuda_kernel ("auto" | "mma" | "wgmma"), or a one-line ValueError.

    "mma" and "wgmma" name kernels of the native CUDA backend; "wgmma" also needs an sm_90 (Hopper)
    device, bf16 / fp16 and head_dim 64 / 128 (the CUDA wrapper checks the same)."""
    op = "paged_prefill_attention"
    if not isinstance(cuda_kernel, str) or cuda_kernel not in PREFILL_KERNELS:
        _fail(ValueError, op, f"cuda_kernel must be one of {tuple(PREFILL_KERNELS)}, got {cuda_kernel!r}")
    if cuda_kernel == "auto":
        return 0
    if backend != "native" or q.device.type != "cuda":
        _fail(
            ValueError,
            op,
            f"cuda_kernel={cuda_kernel!r} selects a kernel of the native CUDA backend; got "
            f"backend={backend!r} with q on {q.device}",
        )
    if cuda_kernel == "wgmma":
        cap = torch.cuda.get_device_capability(q.device)
        if cap != (9, 0):
            _fail(ValueError, op, f"cuda_kernel='wgmma' needs an sm_90 (Hopper) GPU, {q.device} is sm_{cap[0]}{cap[1]}")
        if q.dtype not in (torch.bfloat16, torch.float16):
            _fail(ValueError, op, f"cuda_kernel='wgmma' takes bfloat16 or float16, got {q.dtype}")
        if q.dim() != 3 or q.shape[-1] not in (64, 128):
            _fail(ValueError, op, f"cuda_kernel='wgmma' takes head_dim 64 or 128, got shape {tuple(q.shape)}")
    return PREFILL_KERNELS[cuda_kernel]


def _check_qo(op: str, name: str, indptr, n: int) -> None:
    ip = indptr.cpu()
    if int(ip[0]) != 0 or bool((ip[1:] < ip[:-1]).any()) or int(ip[-1]) != n:
        _fail(ValueError, op, f"{name} must start at 0, be non-decreasing and end at {n}; got {ip.tolist()[:8]}...")


def shared_prefix_attention(
    q,
    group_indptr,
    k_cache,
    v_cache,
    prefix_kv_indptr,
    prefix_kv_indices,
    prefix_kv_last_page_len,
    sm_scale,
    out,
    lse,
    *,
    values: bool = True,
) -> None:
    op = "shared_prefix_attention"
    check_cache_pair(op, k_cache, v_cache)
    check_query(op, q, k_cache, out)
    if lse is None:
        _fail(ValueError, op, "lse is required (the partial result is merged by its LSE)")
    check_lse(op, lse, q)
    check_index(op, "group_indptr", group_indptr, q.device)
    groups = group_indptr.shape[0] - 1
    if groups < 0:
        _fail(ValueError, op, "group_indptr must have shape [G+1] (got an empty tensor)")
    check_page_table(
        op,
        "prefix_",
        prefix_kv_indptr,
        prefix_kv_indices,
        prefix_kv_last_page_len,
        groups,
        k_cache.shape[0],
        k_cache.shape[1],
        q.device,
        values,
    )
    if values:
        _check_qo(op, "group_indptr", group_indptr, q.shape[0])


def merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out) -> None:
    op = "merge_attention_states"
    check_dtype(op, "v_a", v_a, FLOAT_DTYPES)
    check_dim(op, "v_a", v_a, 3)
    for name, t in (("v_b", v_b), ("v_out", v_out)):
        check_same_dtype(op, name, t, "v_a", v_a)
        check_shape(op, name, t, v_a.shape)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b), ("lse_out", lse_out)):
        check_dtype(op, name, t, (torch.float32,))
        check_shape(op, name, t, v_a.shape[:2])
    for name, t in (
        ("v_a", v_a),
        ("lse_a", lse_a),
        ("v_b", v_b),
        ("lse_b", lse_b),
        ("v_out", v_out),
        ("lse_out", lse_out),
    ):
        check_device(op, name, t, v_a.device)
        check_contiguous(op, name, t)


def int8_linear(x: torch.Tensor, w_packed: torch.Tensor, s_packed: torch.Tensor, out: torch.Tensor) -> None:
    """x [M, K] float32 (rows may be strided), w_packed [ceil(N / 16), K / 2, 32] int8 and s_packed
    [ceil(N / 16), K / G, 16] float32 (pack_int8_weight's layout; the group size G a multiple of 32
    dividing K), out [M, N] float32 (csrc/checks.h: check_int8_linear)."""
    op = "int8_linear"
    check_dtype(op, "x", x, (torch.float32, torch.float64))
    check_dtype(op, "w_packed", w_packed, (torch.int8,))
    check_dtype(op, "s_packed", s_packed, (torch.float32,))
    for name, t, dims in (("x", x, 2), ("w_packed", w_packed, 3), ("s_packed", s_packed, 3), ("out", out, 2)):
        if t.dim() != dims:
            _fail(ValueError, op, f"{name} must have {dims} dims (shape {tuple(t.shape)})")
    (m, k), n = x.shape, out.shape[1]
    panels = cdiv(n, 16)
    if tuple(w_packed.shape) != (panels, k // 2, 32) or k % 2:
        _fail(
            ValueError,
            op,
            f"w_packed has shape {tuple(w_packed.shape)}, expected ({panels}, {k // 2}, 32) for x {tuple(x.shape)} "
            f"and out {tuple(out.shape)}",
        )
    groups = s_packed.shape[1]
    if s_packed.shape[0] != panels or s_packed.shape[2] != 16 or groups < 1 or k % groups or (k // groups) % 32:
        _fail(
            ValueError,
            op,
            f"s_packed has shape {tuple(s_packed.shape)}; expected ({panels}, K / group_size, 16) with a "
            f"group_size that divides K={k} and is a multiple of 32",
        )
    check_shape(op, "out", out, (m, n))
    check_same_dtype(op, "out", out, "x", x)
    if x.stride(1) != 1:
        _fail(ValueError, op, "x must have contiguous rows (stride(1) == 1)")
    for name, t in (("w_packed", w_packed), ("s_packed", s_packed), ("out", out)):
        if t.device != x.device:
            _fail(ValueError, op, f"{name} is on device {t.device}, expected {x.device}")
        if not t.is_contiguous():
            _fail(ValueError, op, f"{name} must be contiguous")


def packed_linear(x: torch.Tensor, w_packed: torch.Tensor, out: torch.Tensor) -> None:
    """x [M, K] float32 (rows may be strided), w_packed [ceil(N / 16), K, 16] float32 or bfloat16
    (16-column panels), out [M, N] float32 (csrc/checks.h: check_packed_linear)."""
    op = "packed_linear"
    check_dtype(op, "x", x, (torch.float32, torch.float64))
    check_dtype(op, "w_packed", w_packed, (torch.float32, torch.bfloat16, torch.float64))
    check_dtype(op, "out", out, (torch.float32, torch.float64))
    for name, t, dims in (("x", x, 2), ("w_packed", w_packed, 3), ("out", out, 2)):
        if t.dim() != dims:
            _fail(ValueError, op, f"{name} must have {dims} dims (shape {tuple(t.shape)})")
    (m, k), n = x.shape, out.shape[1]
    panels = cdiv(n, 16)
    if tuple(w_packed.shape) != (panels, k, 16):
        _fail(
            ValueError,
            op,
            f"w_packed has shape {tuple(w_packed.shape)}, expected ({panels}, {k}, 16) for x "
            f"{tuple(x.shape)} and out {tuple(out.shape)} (pack the [N, K] weight with "
            f"minisched.ops.pack_linear_weight)",
        )
    check_shape(op, "out", out, (m, n))
    if x.stride(1) != 1 and k > 1:
        _fail(ValueError, op, "x must have contiguous rows (stride(1) == 1)")
    for name, t in (("w_packed", w_packed), ("out", out)):
        if t.device != x.device:
            _fail(ValueError, op, f"{name} is on device {t.device}, expected {x.device}")
        if not t.is_contiguous():
            _fail(ValueError, op, f"{name} must be contiguous")


GGUF_QTYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}  # GGML type id: (name, bytes per block)


def _gguf(op: str, x, w_packed, qtype, out, *, floats: tuple, w_dtype: torch.dtype, width: int, pack: str) -> None:
    """gguf_linear's and gguf_a8_linear's checks: x [M, K] (rows may be strided; K a multiple of 32, the
    GGUF block), w_packed [ceil(N / 16), K / 32, width x block bytes] of w_dtype (made by ops.`pack`),
    qtype 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), out [M, N]; x and out of `floats`."""
    if isinstance(qtype, bool) or qtype not in GGUF_QTYPES:
        _fail(
            ValueError, op, f"qtype {qtype!r} is not a supported block format (GGML type ids: 2 Q4_0, 3 Q4_1, 8 Q8_0)"
        )
    size = GGUF_QTYPES[qtype][1]
    check_dtype(op, "x", x, floats)
    if w_packed.dtype != w_dtype:
        _fail(
            TypeError,
            op,
            f"w_packed has dtype {w_packed.dtype}, expected {w_dtype} (pack the blocks with minisched.ops.{pack})",
        )
    check_dtype(op, "out", out, floats)
    for name, t, dims in (("x", x, 2), ("w_packed", w_packed, 3), ("out", out, 2)):
        if t.dim() != dims:
            _fail(ValueError, op, f"{name} must have {dims} dims (shape {tuple(t.shape)})")
    (m, k), n = x.shape, out.shape[1]
    if k % 32:
        _fail(ValueError, op, f"K={k} (x {tuple(x.shape)}) is not a multiple of 32, the GGUF block size")
    panels = cdiv(n, 16)
    if tuple(w_packed.shape) != (panels, k // 32, width * size):
        _fail(
            ValueError,
            op,
            f"w_packed has shape {tuple(w_packed.shape)}, expected ({panels}, {k // 32}, {width * size}) for x "
            f"{tuple(x.shape)}, out {tuple(out.shape)} and qtype {qtype} (pack the blocks with "
            f"minisched.ops.{pack})",
        )
    check_shape(op, "out", out, (m, n))
    if x.stride(1) != 1 and k > 1:
        _fail(ValueError, op, "x must have contiguous rows (stride(1) == 1)")
    for name, t in (("w_packed", w_packed), ("out", out)):
        if t.device != x.device:
            _fail(ValueError, op, f"{name} is on device {t.device}, expected {x.device}")
        if not t.is_contiguous():
            _fail(ValueError, op, f"{name} must be contiguous")


def gguf_linear(x: torch.Tensor, w_packed: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """x, out float32 (float64 for the reference), w_packed uint8 [ceil(N / 16), K / 32, 16 x block bytes]
    (pack_gguf_weight's layout); the rest as _gguf (csrc/checks.h: check_gguf_linear)."""
    floats = (torch.float32, torch.float64)
    _gguf("gguf_linear", x, w_packed, qtype, out, floats=floats, w_dtype=torch.uint8, width=16, pack="pack_gguf_weight")


def gguf_a8_linear(x: torch.Tensor, w_packed: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """x, out float32, w_packed int32 [ceil(N / 16), K / 32, 4 x block bytes] (pack_gguf_a8_weight's layout:
    the dtype tells it from gguf_linear's), out not overlapping x; the rest as _gguf (csrc/checks.h:
    check_gguf_a8_linear)."""
    op = "gguf_a8_linear"
    _gguf(
        op, x, w_packed, qtype, out, floats=(torch.float32,), w_dtype=torch.int32, width=4, pack="pack_gguf_a8_weight"
    )
    check_no_overlap(op, "out", out, "x", x)


def rms_norm(x: torch.Tensor, delta, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """x [M, D] float32 contiguous (updated in place when delta is given), delta None or [M, D], weight [D],
    eps > 0, out [M, D] (csrc/checks.h: check_rms_norm)."""
    op = "rms_norm"
    for name, t in (("x", x), ("weight", weight), ("out", out)) + ((("delta", delta),) if delta is not None else ()):
        check_dtype(op, name, t, (torch.float32, torch.float64))
    if x.dim() != 2:
        _fail(ValueError, op, f"x must have 2 dims (shape {tuple(x.shape)})")
    check_shape(op, "weight", weight, (x.shape[1],))
    check_shape(op, "out", out, tuple(x.shape))
    if delta is not None:
        check_shape(op, "delta", delta, tuple(x.shape))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        _fail(ValueError, op, f"eps must be a positive finite number, got {eps!r}")
    for name, t in (("x", x), ("weight", weight), ("out", out)) + ((("delta", delta),) if delta is not None else ()):
        if t.device != x.device:
            _fail(ValueError, op, f"{name} is on device {t.device}, expected {x.device}")
        check_contiguous(op, name, t)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """x [M, 2D] float32 contiguous (gate, then up), out [M, D] contiguous, not overlapping x
    (csrc/checks.h: check_silu_and_mul)."""
    op = "silu_and_mul"
    check_dtype(op, "x", x, (torch.float32, torch.float64))
    check_dim(op, "x", x, 2)
    check_contiguous(op, "x", x)
    if x.shape[1] % 2:
        _fail(ValueError, op, f"x's last dim must be even (gate and up halves), got {x.shape[1]}")
    check_same_dtype(op, "out", out, "x", x)
    check_shape(op, "out", out, (x.shape[0], x.shape[1] // 2))
    check_contiguous(op, "out", out)
    check_device(op, "out", out, x.device)
    check_no_overlap(op, "out", out, "x", x)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """x [N, H, D] float32 (D even; rows may be strided, the last dim not), cos and sin [N, D/2]
    contiguous, out [N, H, D] contiguous, not overlapping x (csrc/checks.h: check_rope)."""
    op = "rope"
    check_dtype(op, "x", x, (torch.float32, torch.float64))
    check_dim(op, "x", x, 3)
    if x.shape[2] % 2:
        _fail(ValueError, op, f"x's head dim must be even, got {x.shape[2]}")
    if x.shape[2] > 1 and x.stride(2) != 1:
        _fail(ValueError, op, f"x's last dim must be contiguous (stride 1), got {x.stride(2)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_same_dtype(op, name, t, "x", x)
        check_shape(op, name, t, (x.shape[0], x.shape[2] // 2))
        check_contiguous(op, name, t)
        check_device(op, name, t, x.device)
    check_same_dtype(op, "out", out, "x", x)
    check_shape(op, "out", out, tuple(x.shape))
    check_contiguous(op, "out", out)
    check_device(op, "out", out, x.device)
    check_no_overlap(op, "out", out, "x", x)
