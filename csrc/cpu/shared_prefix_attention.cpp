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
  AttnParams p{};
  p.q = q.const_data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.qo_indptr = group_indptr.const_data_ptr<int32_t>();
  p.kv_indptr = prefix_kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = prefix_kv_indices.const_data_ptr<int32_t>();
  p.kv_last_page_len = prefix_kv_last_page_len.const_data_ptr<int32_t>();
  p.batch = group_indptr.size(0) - 1;
  p.hq = q.size(1);
  p.hkv = k_cache.size(2);
  p.d = k_cache.size(3);
  p.page_size = k_cache.size(1);
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = false;
  dispatch_float(q.scalar_type(), [&](auto tag) { paged_attention<decltype(tag)>(p); });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("shared_prefix_attention", &shared_prefix_attention); }

}  // namespace minisched::cpu
