// paged_decode_attention on CUDA: one query token per request against its paged KV.
// Split-KV flash decoding: each CTA reads one request's pages for one kv head once for the whole
// GQA group (its rows are the group's q heads), the KV is split so the grid fills the SMs (split
// count from the batch, the mean context length and the device's SM count), and a second pass
// merges the splits by LSE. The kernel is in attention_kernel.cu.
//
// Index values of CUDA page tables are not checked here (that would sync): a page index outside
// [0, num_pages) or an inconsistent indptr/last_page_len is never dereferenced; the request's
// output rows and LSE are written as NaN instead.
#include <torch/library.h>

#include "checks.h"
#include "cuda/torch_glue.cuh"

namespace minisched::cuda {
namespace {

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                            const at::Tensor& kv_last_page_len, double sm_scale, const at::Tensor& out,
                            const std::optional<at::Tensor>& lse) {
  checks::check_paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out, lse);
  run_paged_attention("paged_decode_attention", q, at::Tensor(), k_cache, v_cache, kv_indptr, kv_indices,
                      kv_last_page_len, /*causal=*/false, sm_scale, out,
                      lse.has_value() ? lse->data_ptr<float>() : nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CUDA, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

}  // namespace minisched::cuda
