// shared_prefix_attention on CUDA: rows group_indptr[g]:group_indptr[g+1] of q attend
// (non-causally) to group g's prefix, read once per group per kv head: the group's rows x GQA
// heads form the query tiles, exactly like prefill without the causal mask (and split-KV when
// there are few groups, so a single long shared prefix still fills the GPU). The partial result
// (out, lse) is meant for merge_attention_states. The kernel is in attention_kernel.cu.
//
// Index values of CUDA tensors are not checked (that would sync): bad prefix page indices give
// NaN rows (out and lse) for that group; a group_indptr range outside [0, N] is skipped.
#include <torch/library.h>

#include "checks.h"
#include "cuda/torch_glue.cuh"

namespace minisched::cuda {
namespace {

void shared_prefix_attention(const at::Tensor& q, const at::Tensor& group_indptr, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& prefix_kv_indptr,
                             const at::Tensor& prefix_kv_indices, const at::Tensor& prefix_kv_last_page_len,
                             double sm_scale, const at::Tensor& out, const at::Tensor& lse) {
  checks::check_shared_prefix_attention(q, group_indptr, k_cache, v_cache, prefix_kv_indptr, prefix_kv_indices,
                                        prefix_kv_last_page_len, out, lse);
  run_paged_attention("shared_prefix_attention", q, group_indptr, k_cache, v_cache, prefix_kv_indptr, prefix_kv_indices,
                      prefix_kv_last_page_len, /*causal=*/false, sm_scale, out, lse.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CUDA, m) { m.impl("shared_prefix_attention", &shared_prefix_attention); }

}  // namespace minisched::cuda
