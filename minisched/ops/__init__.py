"""Typed wrappers over the minisched ops: allocate outputs, check inputs, pick the backend.

Backends:
  "native"  torch.ops.minisched.* from the compiled extension (C++ on CPU, CUDA on GPU)
  "triton"  the Triton kernels of triton_kernels/ (minisched.triton_kernels; GPU, or the CPU under TRITON_INTERPRET=1)
  "torch"   the pure-PyTorch reference in minisched.ops.reference (slow; the oracle)

Shapes (docs/architecture.md, "The paged KV cache"): q [N, Hq, D]; one layer's k_cache/v_cache
[num_pages, page_size, Hkv, D]; the whole pool kv_cache [L, 2, num_pages, page_size, Hkv, D]; page
tables are int32 CSR (kv_indptr [B+1], kv_indices [nnz], kv_last_page_len [B]); LSE is float32
[N, Hq], natural log. Which files hold each op: ops/table.py.

`check=False` skips the checks that read index values (the engine validates page tables
on the host before it uploads them); shape/dtype/device checks always run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, Optional

import torch

from minisched.ops import checks, reference
from minisched.ops.cpu import (  # noqa: F401  (re-exported: the CPU kernels' ISA dispatch and pool)
    CPU_ISAS,
    cpu_features,
    cpu_isa,
    cpu_spin_us,
    set_cpu_isa,
    set_cpu_spin_us,
    supported_cpu_isas,
    use_cpu_isa,
)
from minisched.ops.table import OPS, OpSpec  # noqa: F401  (OpSpec: for readers of OPS)

Backend = Literal["native", "triton", "torch"]
BACKENDS: tuple[Backend, ...] = ("native", "triton", "torch")


def as_backend(name: str) -> Backend:
    """`name` as a `Backend` (the type callers holding a plain string need); ValueError for any other."""
    for backend in BACKENDS:
        if backend == name:
            return backend
    raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")


try:  # the extension (csrc/, built by setup.py): importing it registers torch.ops.minisched.*
    from minisched.ops import _C  # type: ignore[attr-defined]  # noqa: F401  (compiled extension: no stub)

    NATIVE_ERROR: Optional[str] = None
except ImportError as exc:  # a source tree that was never built
    NATIVE_ERROR = f"the minisched.ops._C extension is not built ({exc}); run `make build` or `pip install -e .`"

if NATIVE_ERROR is None:
    try:  # one fake per op (torch.compile, opcheck); registering one for an op the extension lacks fails
        from minisched.ops import fakes  # noqa: F401
    except RuntimeError as exc:  # an extension built from older sources: fail here, not at a first call
        raise ImportError(
            f"the minisched.ops._C extension is stale ({exc}); rebuild it: `make build` or `pip install -e .`"
        ) from exc


def native_available() -> bool:
    return NATIVE_ERROR is None


@functools.cache
def triton_launchers() -> dict[str, Callable[..., None]]:
    """{op: its Triton launcher} (triton_kernels/, installed as minisched.triton_kernels). Imported on
    first use: triton is an optional dependency, and importing a kernel module decorates its kernels."""
    from minisched.triton_kernels import (
        kv_pages,
        merge_attention_states,
        paged_decode_attention,
        paged_prefill_attention,
        shared_prefix_attention,
        store_kv,
    )

    return {
        "store_kv": store_kv.store_kv,
        "copy_kv_pages": kv_pages.copy_kv_pages,
        "gather_kv_pages": kv_pages.gather_kv_pages,
        "scatter_kv_pages": kv_pages.scatter_kv_pages,
        "paged_decode_attention": paged_decode_attention.paged_decode_attention,
        "paged_prefill_attention": paged_prefill_attention.paged_prefill_attention,
        "shared_prefix_attention": shared_prefix_attention.shared_prefix_attention,
        "merge_attention_states": merge_attention_states.merge_attention_states,
    }


def call_op(name: str, args: tuple, backend: Backend = "native", check: bool = True) -> None:
    """Run op `name` with its full argument list (outputs preallocated by the caller) on `backend`."""
    if backend == "native":
        if NATIVE_ERROR is not None:
            raise RuntimeError(NATIVE_ERROR)
        getattr(torch.ops.minisched, name)(*args)
        return
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    spec = OPS[name]
    if backend == "triton" and not spec.triton:
        raise ValueError(f"{name} has no triton kernel: it runs on the native (CPU) or torch backend")
    spec.input_checks(values=check)(*args)
    if backend == "torch":
        getattr(reference, name)(*args)
    else:
        triton_launchers()[name](*args)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# -- KV cache movement ---------------------------------------------------------------------------


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = "native",
    check: bool = True,
) -> None:
    """Write N tokens' k, v [N, Hkv, D] into one layer's caches at slot_mapping int32[N] (< 0: skip)."""
    call_op("store_kv", (k, v, k_cache, v_cache, slot_mapping), backend, check)


def copy_kv_pages(
    kv_cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    *,
    backend: Backend = "native",
    check: bool = True,
) -> None:
    """kv_cache[:, :, dst_pages[i]] = kv_cache[:, :, src_pages[i]] for all layers, K and V."""
    call_op("copy_kv_pages", (kv_cache, src_pages, dst_pages), backend, check)


def gather_kv_pages(
    kv_cache: torch.Tensor,
    pages: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    backend: Backend = "native",
    check: bool = True,
) -> torch.Tensor:
    """Copy pages out of the pool into out [L, 2, n, page_size, Hkv, D] (may be pinned host memory)."""
    if out is None:
        out = kv_cache.new_empty((*kv_cache.shape[:2], pages.shape[0], *kv_cache.shape[3:]))
    call_op("gather_kv_pages", (kv_cache, pages, out), backend, check)
    return out


def scatter_kv_pages(
    src: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor, *, backend: Backend = "native", check: bool = True
) -> None:
    """Copy src [L, 2, n, page_size, Hkv, D] back into the pool at pages int32[n]."""
    call_op("scatter_kv_pages", (src, kv_cache, pages), backend, check)


# -- attention -----------------------------------------------------------------------------------


def _outputs(q: torch.Tensor, return_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else None
    return out, lse


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    *,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    backend: Backend = "native",
    check: bool = True,
):
    """One query per request, q [B, Hq, D], over its paged KV. Returns out [B, Hq, D] (and lse [B, Hq])."""
    out, lse = _outputs(q, return_lse)
    scale = default_scale(q.shape[-1]) if sm_scale is None else sm_scale
    call_op(
        "paged_decode_attention",
        (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, scale, out, lse),
        backend,
        check,
    )
    return (out, lse) if return_lse else out


def paged_prefill_attention(
    q,
    qo_indptr,
    k_cache,
    v_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    *,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    backend: Backend = "native",
    check: bool = True,
    cuda_kernel: str = "auto",
):
    """Ragged queries q [Nq, Hq, D] (request b: rows qo_indptr[b]:qo_indptr[b+1], the LAST positions
    of its KV; causal is bottom-right aligned). Returns out [Nq, Hq, D] (and lse [Nq, Hq]).

    cuda_kernel (native backend on CUDA): "auto" (today the mma.sync kernel: the wgmma kernel has not
    run on hardware yet), "mma" (mma.sync, FA2-style, split-KV), "wgmma" (Hopper warpgroup MMA,
    one KV split; sm_90, bf16/fp16, head_dim 64/128). A ValueError for anything else."""
    kernel = checks.prefill_cuda_kernel(q, cuda_kernel, backend)
    out, lse = _outputs(q, return_lse)
    scale = default_scale(q.shape[-1]) if sm_scale is None else sm_scale
    call_op(
        "paged_prefill_attention",
        (q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, causal, scale, out, lse, kernel),
        backend,
        check,
    )
    return (out, lse) if return_lse else out


def shared_prefix_attention(
    q,
    group_indptr,
    k_cache,
    v_cache,
    prefix_kv_indptr,
    prefix_kv_indices,
    prefix_kv_last_page_len,
    *,
    sm_scale: Optional[float] = None,
    backend: Backend = "native",
    check: bool = True,
):
    """Rows group_indptr[g]:group_indptr[g+1] of q [N, Hq, D] attend to group g's shared prefix, read once
    per group (non-causal). Returns (out [N, Hq, D], lse [N, Hq]) for merge_attention_states."""
    out, lse = _outputs(q, True)
    scale = default_scale(q.shape[-1]) if sm_scale is None else sm_scale
    call_op(
        "shared_prefix_attention",
        (
            q,
            group_indptr,
            k_cache,
            v_cache,
            prefix_kv_indptr,
            prefix_kv_indices,
            prefix_kv_last_page_len,
            scale,
            out,
            lse,
        ),
        backend,
        check,
    )
    return out, lse


def merge_attention_states(v_a, lse_a, v_b, lse_b, *, backend: Backend = "native"):
    """Merge two partial attentions (v [N, H, D], lse [N, H] float32) over disjoint KV sets."""
    v_out = torch.empty_like(v_a)
    lse_out = torch.empty_like(lse_a)
    call_op("merge_attention_states", (v_a, lse_a, v_b, lse_b, v_out, lse_out), backend)
    return v_out, lse_out


def cascade_decode_attention(
    q,
    group_indptr,
    k_cache,
    v_cache,
    prefix_table,
    suffix_table,
    *,
    sm_scale: Optional[float] = None,
    backend: Backend = "native",
    check: bool = True,
):
    """Decode with prefix sharing: shared prefix once per group + each request's own suffix, merged.

    prefix_table: (indptr, indices, last_page_len) with one entry per group;
    suffix_table: the same with one entry per request (q row)."""
    o_p, lse_p = shared_prefix_attention(
        q, group_indptr, k_cache, v_cache, *prefix_table, sm_scale=sm_scale, backend=backend, check=check
    )
    o_s, lse_s = paged_decode_attention(
        q, k_cache, v_cache, *suffix_table, sm_scale=sm_scale, return_lse=True, backend=backend, check=check
    )
    out, _ = merge_attention_states(o_p, lse_p, o_s, lse_s, backend=backend)
    return out


# -- int8 weights ---------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 for w [N, K]: one float32 scale per group of `group_size` input channels
    (max |w| of the group maps to 127). Returns (w_q int8 [N, K], scales float32 [N, K // group_size])."""
    n, k = w.shape
    if group_size < 32 or group_size % 32 or k % group_size:
        raise ValueError(f"quantize_int8: group_size={group_size} must be a multiple of 32 that divides K={k}")
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
    w_q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return w_q.contiguous(), scales.contiguous()


def pack_int8_weight(w_q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8's (w_q [N, K], scales [N, K // G]) in int8_linear's layout: 16-column panels with
    the input channels in pairs, (w_packed int8 [ceil(N / 16), K / 2, 32], s_packed float32
    [ceil(N / 16), K // G, 16]). Done once, when the model is quantized."""
    if w_q.dim() != 2 or scales.dim() != 2 or scales.shape[0] != w_q.shape[0] or w_q.shape[1] % 32:
        raise ValueError(
            f"pack_int8_weight: expected w_q [N, K] (K a multiple of 32) and scales [N, K // G], got "
            f"{tuple(w_q.shape)} and {tuple(scales.shape)}"
        )
    return reference.pack_int8_weight(w_q.detach(), scales.detach())


def int8_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    s_packed: torch.Tensor,
    n: int,
    *,
    backend: Backend = "native",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, n] (float32) for the int8 weight W packed by pack_int8_weight: each row
    of x is quantized to int16 on the fly (one scale per row), the products summed in int32 by the
    CPU's integer dot-product instructions, the group scales applied in float32."""
    if out is None:
        out = x.new_empty((x.shape[0], n))
    call_op("int8_linear", (x, w_packed, s_packed, out), backend)
    return out


# -- packed float32 linear -----------------------------------------------------------------------


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """An [N, K] weight in packed_linear's layout: panels of 16 output columns, [ceil(N / 16), K, 16]
    (zero past N). Done once, when the model is loaded."""
    if w.dim() != 2:
        raise ValueError(f"pack_linear_weight: expected an [N, K] weight, got shape {tuple(w.shape)}")
    return reference.pack_linear_weight(w.detach())


def packed_linear(
    x: torch.Tensor, w_packed: torch.Tensor, n: int, *, backend: Backend = "native", out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, n] for w packed by pack_linear_weight (n = the weight's N)."""
    if out is None:
        out = x.new_empty((x.shape[0], n))
    call_op("packed_linear", (x, w_packed, out), backend)
    return out


# -- GGUF block weights ---------------------------------------------------------------------------

# The GGUF block formats gguf_linear runs, by name: GGML's type ids (gguf.GGMLQuantizationType).
GGUF_QTYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def _check_gguf_blocks(fn: str, blocks: torch.Tensor, qtype: int) -> None:
    """A GGUF tensor's blocks as the pack functions take them: uint8 [N, K / 32 * block bytes] of a supported qtype."""
    if qtype not in reference.GGUF_BLOCK_BYTES or isinstance(qtype, bool):
        raise ValueError(f"{fn}: qtype {qtype!r} is not one of {GGUF_QTYPES}")
    size = reference.GGUF_BLOCK_BYTES[qtype]
    if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % size:
        raise ValueError(
            f"{fn}: expected uint8 blocks [N, K / 32 * {size}] for qtype {qtype}, got {blocks.dtype} {tuple(blocks.shape)}"
        )


def pack_gguf_weight(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, K / 32 * block bytes] (one row per output row, as the file
    holds them), in gguf_linear's layout: panels of 16 rows, [ceil(N / 16), K / 32, 16 x block bytes]
    (zero past N), each block's scales of the 16 rows first, then their quants with the rows innermost.
    Done once, when the model is loaded."""
    _check_gguf_blocks("pack_gguf_weight", blocks, qtype)
    return reference.pack_gguf_weight(blocks.detach(), qtype)


def gguf_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    qtype: int,
    n: int,
    *,
    backend: Backend = "native",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, n] (float32) for the GGUF-block weight W packed by pack_gguf_weight (qtype:
    GGUF_QTYPES' ids), dequantized to float32 as it is read: the bits of packed_linear on the
    dequantized weight."""
    if out is None:
        out = x.new_empty((x.shape[0], n))
    call_op("gguf_linear", (x, w_packed, qtype, out), backend)
    return out


def pack_gguf_a8_weight(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """A GGUF tensor's blocks, uint8 [N, K / 32 * block bytes], in gguf_a8_linear's layout: int32
    [ceil(N / 16), K / 32, 4 x block bytes], pack_gguf_weight's panel-blocks with each row's quant bytes
    in 32-bit lanes (reference.pack_gguf_a8_weight). Done once, when the model is loaded."""
    _check_gguf_blocks("pack_gguf_a8_weight", blocks, qtype)
    return reference.pack_gguf_a8_weight(blocks.detach(), qtype)


def gguf_a8_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    qtype: int,
    n: int,
    *,
    backend: Backend = "native",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, n] (float32) for the GGUF-block weight W packed by pack_gguf_a8_weight, with
    each block of 32 activations rounded to 8 bits first (reference.quantize_a8: x^ = dx * round(x /
    dx), dx = max |x| / 127) and the products summed in int32 (VNNI's vpdpbusd): llama.cpp's Q8 trade,
    close to gguf_linear's float32 result, not its bits."""
    if out is None:
        out = x.new_empty((x.shape[0], n))
    call_op("gguf_a8_linear", (x, w_packed, qtype, out), backend)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: Optional[torch.Tensor] = None,
    backend: Backend = "native",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RMSNorm of x [M, D] (float32) times weight [D]; with `delta` [M, D], first x += delta in place
    (the residual add, fused). Returns out [M, D]."""
    if out is None:
        out = torch.empty_like(x)
    call_op("rms_norm", (x, delta, weight, eps, out), backend)
    return out


def silu_and_mul(x: torch.Tensor, *, backend: Backend = "native", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU's activation: silu(x[:, :D]) * x[:, D:] for x [M, 2D] (float32; the fused gate_up
    projection's output). Returns out [M, D]."""
    if out is None:
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
    call_op("silu_and_mul", (x, out), backend)
    return out


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: Backend = "native",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Half-rotation RoPE of x [N, H, D] (float32; rows may be strided, e.g. the q or k columns of a
    fused qkv projection) with cos, sin [N, D/2]: out[.., j] = x[.., j] cos_j - x[.., j + D/2] sin_j,
    out[.., j + D/2] = x[.., j + D/2] cos_j + x[.., j] sin_j. Returns out [N, H, D], contiguous. Native: each
    product rounded before the sum, bitwise torch's `x * cos + rotate_half(x) * sin` in float32."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    call_op("rope", (x, cos, sin, out), backend)
    return out
