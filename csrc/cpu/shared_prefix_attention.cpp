// shared_prefix_attention on the CPU: rows group_indptr[g]:group_indptr[g+1] of q [N, Hq, D]
// attend (non-causally) to group g's shared prefix (entry g of the prefix page table). Each
// (group, kv head, tile of queries) work item streams the prefix once for all its query rows,
// so the prefix is read once per tile instead of once per request. lse is always written: it
// is what merge_attention_states combines with the per-request suffix. See attention_cpu.h.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/attention_cpu.h"

namespace minisched::cpu {
namespace {

void shared_prefix_attention(const at::Tensor& q, const at::Tensor& group_indptr, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& prefix_kv_indptr,
                             const at::Tensor& prefix_kv_indices, const at::Tensor& prefix_kv_last_page_len,
                             double sm_scale, const at::Tensor& out, const at::Tensor& lse) {
  checks::check_shared_prefix_attention(q, group_indptr, k_cache, v_cache, prefix_kv_indptr, prefix_kv_indices,
                                        prefix_kv_last_page_len, out, lse);
  run_paged_attention(q, group_indptr.const_data_ptr<int32_t>(), group_indptr.size(0) - 1, k_cache, v_cache,
                      prefix_kv_indptr, prefix_kv_indices, prefix_kv_last_page_len, /*causal=*/false, sm_scale, out,
                      lse.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("shared_prefix_attention", &shared_prefix_attention); }

}  // namespace minisched::cpu
