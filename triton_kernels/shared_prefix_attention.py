"""shared_prefix_attention: rows group_indptr[g]:group_indptr[g+1] of q [N, Hq, D] attend,
non-causally, to group g's shared prefix (entry g of the prefix page table); lse is required
(the result is merged with each request's suffix by merge_attention_states).

This is the paged prefill kernel run non-causally with the group's rows as its "queries":
a program packs BLOCK_M (query, head-in-group) rows of one group, so the prefix K/V is read
once per BLOCK_M rows and kv head instead of once per request.
"""

import torch
from torch.library import triton_op

from .paged_prefill_attention import _launch


@triton_op("minisched_triton::shared_prefix_attention", mutates_args={"out", "lse"})
def _shared_prefix_attention_op(
    q: torch.Tensor,
    group_indptr: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    prefix_kv_last_page_len: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    _launch(
        q,
        group_indptr,
        k_cache,
        v_cache,
        prefix_kv_indptr,
        prefix_kv_indices,
        prefix_kv_last_page_len,
        False,
        sm_scale,
        out,
        lse,
    )


def shared_prefix_attention(
    q, group_indptr, k_cache, v_cache, prefix_kv_indptr, prefix_kv_indices, prefix_kv_last_page_len, sm_scale, out, lse
) -> None:
    torch.ops.minisched_triton.shared_prefix_attention(
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
    )
