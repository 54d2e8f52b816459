// Host-side glue shared by the CUDA op wrappers: current stream, SM count, workspace tensors,
// launch-error checks. (Kernels themselves take raw pointers; see attention_utils.cuh.)
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "checks.h"
#include "cuda/attention_utils.cuh"

namespace minisched::cuda {

#define MINISCHED_CUDA_CHECK(op, expr)                                                                  \
  do {                                                                                                  \
    const cudaError_t err_ = (expr);                                                                    \
    TORCH_CHECK(err_ == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(err_), " (", #expr, ")"); \
  } while (0)

inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Multiprocessor count of device `index`, read once per device.
inline int sm_count(int index) {
  static int cached[64] = {0};
  if (index < 0 || index >= 64) index = 0;
  if (cached[index] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, index) != cudaSuccess || n <= 0) n = 132;
    cached[index] = n;
  }
  return cached[index];
}

// Work buffers as torch tensors (the caching allocator: stream-ordered, no sync); kept alive
// until the wrapper returns, which is enough because later reuse is ordered on the same stream.
struct TorchWorkspace final : WorkspaceAllocator {
  explicit TorchWorkspace(at::Device device) : device_(device) {}
  void* allocate(size_t bytes) override {
    const int64_t n = int64_t((bytes + 15) / 16) * 16;
    buffers_.push_back(at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device_)));
    return buffers_.back().data_ptr();
  }

 private:
  at::Device device_;
  std::vector<at::Tensor> buffers_;
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace minisched::cuda

namespace minisched::cuda {

// The wgmma prefill kernel (attention_wgmma.cu) is built for sm_90a only: a Hopper device (compute
// capability 9.0), bf16 / fp16, head_dim 64 or 128. A ValueError otherwise.
inline void check_wgmma_prefill(const char* op, const at::Tensor& q) {
  int major = 0, minor = 0;
  const int dev = q.device().index();
  MINISCHED_CUDA_CHECK(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MINISCHED_CUDA_CHECK(op, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  TORCH_CHECK_VALUE(major == 9 && minor == 0, op, ": the wgmma kernel needs an sm_90 (Hopper) GPU, device ", dev,
                    " is sm_", major, minor);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
                    ": the wgmma kernel takes bfloat16 or float16, got ", checks::dtype_name(q.scalar_type()));
  TORCH_CHECK_VALUE(q.size(2) == 64 || q.size(2) == 128, op, ": the wgmma kernel takes head_dim 64 or 128, got ",
                    q.size(2));
}

// The common tail of the three attention wrappers (inputs already checked by checks.h):
// fills AttentionParams and launches the paged attention kernel on the current stream.
// qo_indptr undefined: decode (one query per request).
inline void run_paged_attention(const char* op, const at::Tensor& q, const at::Tensor& qo_indptr,
                                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& kv_indptr,
                                const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len, bool causal,
                                double sm_scale, const at::Tensor& out, float* lse, bool wgmma = false) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op, ": q has dtype ",
                   checks::dtype_name(q.scalar_type()),
                   ", expected one of (torch.bfloat16, torch.float16) on CUDA (float32 attention runs on the CPU)");
  const int64_t d = q.size(2);
  TORCH_CHECK_VALUE(d == 64 || d == 128, op, ": head_dim ", d,
                    " is not supported by the CUDA kernel (shape must have head_dim 64 or 128)");
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &out})
    TORCH_CHECK_VALUE(aligned16(t->data_ptr()), op,
                      ": q/k_cache/v_cache/out must be 16-byte aligned (contiguous "
                      "views starting on a 16-byte boundary)");
  TORCH_CHECK_VALUE(
      q.size(0) < (int64_t(1) << 30) && k_cache.size(0) < (int64_t(1) << 31) && kv_indices.numel() < (int64_t(1) << 31),
      op, ": shape too large for int32 indexing");
  const int64_t batch = kv_indptr.size(0) - 1;
  if (q.size(0) == 0 || batch <= 0) return;
  const c10::cuda::CUDAGuard guard(q.device());

  AttentionParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse;
  p.qo_indptr = qo_indptr.defined() ? qo_indptr.data_ptr<int32_t>() : nullptr;
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.kv_last_page_len = kv_last_page_len.data_ptr<int32_t>();
  p.batch = int(batch);
  p.num_qo = int(q.size(0));
  p.num_heads = int(q.size(1));
  p.num_kv_heads = int(k_cache.size(2));
  p.group = p.num_heads / p.num_kv_heads;
  p.num_pages = int(k_cache.size(0));
  p.page_size = int(k_cache.size(1));
  p.page_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((int64_t(1) << sh) == k_cache.size(1)) p.page_shift = sh;
  p.nnz = int(kv_indices.numel());
  p.causal = causal;
  p.scale_log2 = float(sm_scale * 1.4426950408889634);
  const int64_t est_kv_len = kv_indices.numel() * k_cache.size(1) / batch;
  TorchWorkspace ws(q.device());
  if (wgmma) {  // prefill only (qo_indptr defined), eligibility checked by check_wgmma_prefill
    MINISCHED_CUDA_CHECK(
        op, launch_paged_attention_wgmma(p, q.scalar_type() == at::kBFloat16, int(d), ws, current_stream(q)));
    return;
  }
  MINISCHED_CUDA_CHECK(op, launch_paged_attention(p, q.scalar_type() == at::kBFloat16, int(d), est_kv_len,
                                                  sm_count(q.device().index()), ws, current_stream(q)));
}

}  // namespace minisched::cuda
