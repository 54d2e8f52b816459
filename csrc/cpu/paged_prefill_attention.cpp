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
                             const std::optional<at::Tensor>& lse) {
  checks::check_paged_prefill_attention(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                                        out, lse);
  AttnParams p{};
  p.q = q.const_data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.qo_indptr = qo_indptr.const_data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.kv_last_page_len = kv_last_page_len.const_data_ptr<int32_t>();
  p.batch = qo_indptr.size(0) - 1;
  p.hq = q.size(1);
  p.hkv = k_cache.size(2);
  p.d = k_cache.size(3);
  p.page_size = k_cache.size(1);
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = causal;
  dispatch_float(q.scalar_type(), [&](auto tag) { paged_attention<decltype(tag)>(p); });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }

}  // namespace minisched::cpu
