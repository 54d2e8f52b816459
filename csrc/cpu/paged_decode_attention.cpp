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
  run_paged_attention(q, /*qo_indptr=*/nullptr, q.size(0), k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len,
                      /*causal=*/false, sm_scale, out, lse.has_value() ? lse->data_ptr<float>() : nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

}  // namespace minisched::cpu
