// paged_prefill_attention on the CPU: ragged queries q [Nq, Hq, D]; request b's queries are rows
// qo_indptr[b]:qo_indptr[b+1], the LAST qo_len_b positions of its paged KV; causal masking is
// bottom-right aligned (query t sees KV positions <= kv_len - qo_len + t). See attention_cpu.h.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "checks.h"
#include "cpu/attention_cpu.h"

namespace minisched::cpu {
namespace {

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                             const at::Tensor& kv_last_page_len, bool causal, double sm_scale, const at::Tensor& out,
                             const std::optional<at::Tensor>& lse, int64_t kernel) {
  // kernel picks a CUDA kernel; the CPU has one (checked for range only)
  checks::check_paged_prefill_attention(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out,
                                        lse, kernel);
  run_paged_attention(q, qo_indptr.const_data_ptr<int32_t>(), qo_indptr.size(0) - 1, k_cache, v_cache, kv_indptr,
                      kv_indices, kv_last_page_len, causal, sm_scale, out,
                      lse.has_value() ? lse->data_ptr<float>() : nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }

}  // namespace minisched::cpu
