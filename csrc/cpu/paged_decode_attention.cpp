// paged_decode_attention on the CPU: one query token per request, q [B, Hq, D], against the
// request's whole paged KV, read in place through the CSR page table (see attention_cpu.h).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "checks.h"
#include "cpu/attention_cpu.h"

namespace minisched::cpu {
namespace {

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                            const at::Tensor& kv_last_page_len, double sm_scale, const at::Tensor& out,
                            const std::optional<at::Tensor>& lse) {
  checks::check_paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out, lse);
  AttnParams p{};
  p.q = q.const_data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.qo_indptr = nullptr;  // request b's query is row b
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.kv_last_page_len = kv_last_page_len.const_data_ptr<int32_t>();
  p.batch = q.size(0);
  p.hq = q.size(1);
  p.hkv = k_cache.size(2);
  p.d = k_cache.size(3);
  p.page_size = k_cache.size(1);
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = false;
  dispatch_float(q.scalar_type(), [&](auto tag) { paged_attention<decltype(tag)>(p); });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

}  // namespace minisched::cpu
