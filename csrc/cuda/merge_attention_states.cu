// merge_attention_states on CUDA: combine two partial attentions over disjoint KV sets by
// log-sum-exp, elementwise over [N, H, D], 16-byte vectors along D. The arithmetic mirrors
// minisched.reference exactly: m = max(lse_a, lse_b) (NaN propagates), m = 0 when it is +-inf
// (both sides empty), w = exp(lse - m), out = (v_a w_a + v_b w_b) / (total > 0 ? total : 1),
// lse = m + log(total) — so an empty side (lse -inf) has weight 0 and two empty sides give
// out 0, lse -inf. Accumulation in float32.
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "checks.h"
#include "cuda/torch_glue.cuh"

namespace minisched::cuda {
namespace {

template <typename T>
__device__ __forceinline__ float to_f(T x) {
  return float(x);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_f<__half>(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T from_f(float x) {
  return T(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float x) {
  return __float2half(x);
}

// VEC elements per thread (16 bytes when D allows it, else 1).
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
    merge_states_kernel(const T* __restrict__ v_a, const float* __restrict__ lse_a, const T* __restrict__ v_b,
                        const float* __restrict__ lse_b, T* __restrict__ v_out, float* __restrict__ lse_out,
                        long long rows, int d) {
  struct alignas(sizeof(T) * VEC) Vec {
    T x[VEC];
  };
  const int vecs = d / VEC;
  const long long total = rows * vecs;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long rh = idx / vecs;
    const int c = int(idx % vecs);
    const float la = lse_a[rh], lb = lse_b[rh];
    float m = (la != la || lb != lb) ? __int_as_float(0x7fc00000) : fmaxf(la, lb);  // torch.maximum keeps NaN
    if (isinf(m)) m = 0.f;
    const float wa = __expf(la - m), wb = __expf(lb - m);
    const float total_w = wa + wb;
    const float div = total_w > 0.f ? total_w : 1.f;
    const Vec a = reinterpret_cast<const Vec*>(v_a + rh * d)[c];
    const Vec b = reinterpret_cast<const Vec*>(v_b + rh * d)[c];
    Vec o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) o.x[k] = from_f<T>((to_f(a.x[k]) * wa + to_f(b.x[k]) * wb) / div);
    reinterpret_cast<Vec*>(v_out + rh * d)[c] = o;
    if (c == 0) lse_out[rh] = m + __logf(total_w);
  }
}

template <typename T>
void launch(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b, const at::Tensor& lse_b,
            const at::Tensor& v_out, const at::Tensor& lse_out, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const long long rows = v_a.size(0) * v_a.size(1);
  const int d = int(v_a.size(2));
  const bool vec =
      d % kVec == 0 && aligned16(v_a.data_ptr()) && aligned16(v_b.data_ptr()) && aligned16(v_out.data_ptr());
  const long long total = rows * (vec ? d / kVec : d);
  const int blocks = int(std::min<long long>((total + 255) / 256, 65535LL * 8));
  if (blocks == 0) return;
  auto* a = reinterpret_cast<const T*>(v_a.data_ptr());
  auto* b = reinterpret_cast<const T*>(v_b.data_ptr());
  auto* o = reinterpret_cast<T*>(v_out.data_ptr());
  if (vec)
    merge_states_kernel<T, kVec><<<blocks, 256, 0, stream>>>(a, lse_a.data_ptr<float>(), b, lse_b.data_ptr<float>(), o,
                                                             lse_out.data_ptr<float>(), rows, d);
  else
    merge_states_kernel<T, 1><<<blocks, 256, 0, stream>>>(a, lse_a.data_ptr<float>(), b, lse_b.data_ptr<float>(), o,
                                                          lse_out.data_ptr<float>(), rows, d);
}

void merge_attention_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b,
                            const at::Tensor& lse_b, const at::Tensor& v_out, const at::Tensor& lse_out) {
  checks::check_merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out);
  if (v_a.numel() == 0) return;  // empty batch (D = 0 is not a real head size)
  const c10::cuda::CUDAGuard guard(v_a.device());
  const cudaStream_t stream = current_stream(v_a);
  switch (v_a.scalar_type()) {
    case at::kBFloat16:
      launch<__nv_bfloat16>(v_a, lse_a, v_b, lse_b, v_out, lse_out, stream);
      break;
    case at::kHalf:
      launch<__half>(v_a, lse_a, v_b, lse_b, v_out, lse_out, stream);
      break;
    default:
      launch<float>(v_a, lse_a, v_b, lse_b, v_out, lse_out, stream);
      break;
  }
  MINISCHED_CUDA_CHECK("merge_attention_states", cudaGetLastError());
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CUDA, m) { m.impl("merge_attention_states", &merge_attention_states); }

}  // namespace minisched::cuda
