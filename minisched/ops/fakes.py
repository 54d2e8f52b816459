"""The fake (meta) kernels of the native ops: one per op, with the op's own signature.

torch.compile and torch.library.opcheck run an op on FakeTensors (shapes, dtypes and devices, no
data) through these. The ops write into preallocated outputs and return nothing, so a fake only runs
the op's input checks -- without the ones that read index values, which a FakeTensor does not have.
csrc/torch_bindings.cpp names this module (`m.set_python_module`): torch checks that the fakes are
registered from here and, where one is missing, names the module in its error. minisched.ops imports
it right after the extension.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from minisched.ops import checks

# -- KV cache movement ---------------------------------------------------------------------------


@torch.library.register_fake("minisched::store_kv")
def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    checks.store_kv(k, v, k_cache, v_cache, slot_mapping, values=False)


@torch.library.register_fake("minisched::copy_kv_pages")
def copy_kv_pages(kv_cache: Tensor, src_pages: Tensor, dst_pages: Tensor) -> None:
    checks.copy_kv_pages(kv_cache, src_pages, dst_pages, values=False)


@torch.library.register_fake("minisched::gather_kv_pages")
def gather_kv_pages(kv_cache: Tensor, pages: Tensor, out: Tensor) -> None:
    checks.gather_kv_pages(kv_cache, pages, out, values=False)


@torch.library.register_fake("minisched::scatter_kv_pages")
def scatter_kv_pages(src: Tensor, kv_cache: Tensor, pages: Tensor) -> None:
    checks.scatter_kv_pages(src, kv_cache, pages, values=False)


# -- attention -----------------------------------------------------------------------------------


@torch.library.register_fake("minisched::paged_decode_attention")
def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    sm_scale: float,
    out: Tensor,
    lse: Optional[Tensor],
) -> None:
    checks.paged_decode_attention(
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out, lse, values=False
    )


@torch.library.register_fake("minisched::paged_prefill_attention")
def paged_prefill_attention(
    q: Tensor,
    qo_indptr: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    causal: bool,
    sm_scale: float,
    out: Tensor,
    lse: Optional[Tensor],
    kernel: int = 0,
) -> None:
    checks.paged_prefill_attention(
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
        lse,
        kernel,
        values=False,
    )


@torch.library.register_fake("minisched::shared_prefix_attention")
def shared_prefix_attention(
    q: Tensor,
    group_indptr: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    prefix_kv_indptr: Tensor,
    prefix_kv_indices: Tensor,
    prefix_kv_last_page_len: Tensor,
    sm_scale: float,
    out: Tensor,
    lse: Tensor,
) -> None:
    checks.shared_prefix_attention(
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
        values=False,
    )


@torch.library.register_fake("minisched::merge_attention_states")
def merge_attention_states(
    v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor, v_out: Tensor, lse_out: Tensor
) -> None:
    checks.merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out)


# -- CPU matmuls and norm (their checks read no values) ------------------------------------------


@torch.library.register_fake("minisched::int8_linear")
def int8_linear(x: Tensor, w_packed: Tensor, s_packed: Tensor, out: Tensor) -> None:
    checks.int8_linear(x, w_packed, s_packed, out)


@torch.library.register_fake("minisched::packed_linear")
def packed_linear(x: Tensor, w_packed: Tensor, out: Tensor) -> None:
    checks.packed_linear(x, w_packed, out)


@torch.library.register_fake("minisched::gguf_linear")
def gguf_linear(x: Tensor, w_packed: Tensor, qtype: int, out: Tensor) -> None:
    checks.gguf_linear(x, w_packed, qtype, out)


@torch.library.register_fake("minisched::gguf_a8_linear")
def gguf_a8_linear(x: Tensor, w_packed: Tensor, qtype: int, out: Tensor) -> None:
    checks.gguf_a8_linear(x, w_packed, qtype, out)


@torch.library.register_fake("minisched::rms_norm")
def rms_norm(x: Tensor, delta: Optional[Tensor], weight: Tensor, eps: float, out: Tensor) -> None:
    checks.rms_norm(x, delta, weight, eps, out)


@torch.library.register_fake("minisched::silu_and_mul")
def silu_and_mul(x: Tensor, out: Tensor) -> None:
    checks.silu_and_mul(x, out)


@torch.library.register_fake("minisched::rope")
def rope(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> None:
    checks.rope(x, cos, sin, out)
