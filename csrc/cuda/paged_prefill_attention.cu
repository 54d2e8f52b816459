// paged_prefill_attention on CUDA: ragged queries (request b: rows qo_indptr[b]:qo_indptr[b+1],
// the last qo_len_b positions of its KV) on tensor cores (mma.sync m16n8k16; on request, kernel = 2, the
// Hopper wgmma kernel of attention_wgmma.cu), online softmax,
// causal bottom-right aligned (query i sees KV positions <= kv_len - qo_len + i), KV pages
// gathered by the page table. Rows of a query tile (128 rows; 64 for short extends) are (token,
// head-in-GQA-group) pairs, so each K/V tile is read once for the whole group. A device-side tile
// map (prefix sum of each request's tile count) avoids a host sync. The kernel is in
// attention_kernel.cu.
//
// Index values of CUDA tensors are not checked (that would sync): bad page indices / page table
// entries give NaN rows for that request; a qo_indptr range outside [0, Nq] is skipped.
#include <torch/library.h>

#include "checks.h"
#include "cuda/torch_glue.cuh"

namespace minisched::cuda {
namespace {

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                             const at::Tensor& kv_last_page_len, bool causal, double sm_scale, const at::Tensor& out,
                             const std::optional<at::Tensor>& lse, int64_t kernel) {
  checks::check_paged_prefill_attention(q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, out,
                                        lse, kernel);
  // kernel 0 (auto) is the mma.sync kernel for now: the wgmma kernel has never run on hardware; the
  // first GPU session that passes tests/ops/test_cuda_kernels.py on it flips auto (eligible shapes
  // whose split choice is 1) to wgmma.
  const bool wgmma = kernel == 2;
  if (wgmma) check_wgmma_prefill("paged_prefill_attention", q);
  run_paged_attention("paged_prefill_attention", q, qo_indptr, k_cache, v_cache, kv_indptr, kv_indices,
                      kv_last_page_len, causal, sm_scale, out, lse.has_value() ? lse->data_ptr<float>() : nullptr,
                      wgmma);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CUDA, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }

}  // namespace minisched::cuda
