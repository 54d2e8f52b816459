// store_kv on CUDA: write N tokens' K/V rows [Hkv, D] into one layer's paged caches at
// slot_mapping[t] (page * page_size + offset; < 0: skip). Threads move 16-byte vectors of a K row and
// the same vectors of the V row; a warp covers consecutive vectors of one row (coalesced). k/v may be strided over tokens (e.g. slices of a fused QKV output) as long as
// each token's [Hkv, D] row is contiguous; otherwise they are made contiguous first.
//
// Slot values of a CUDA slot_mapping are not checked on the host (that would sync): a slot
// >= num_pages * page_size is skipped like a negative one (never written out of bounds).
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "cuda/torch_glue.cuh"

namespace minisched::cuda {
namespace {

// threadIdx.x strides over a row's vectors, threadIdx.y (and the grid) over tokens.
template <typename V>
__global__ void __launch_bounds__(256)
    store_kv_kernel(const V* __restrict__ k, const V* __restrict__ v, long long k_stride,
                    long long v_stride,  // in V units
                    V* __restrict__ k_cache, V* __restrict__ v_cache, const int32_t* __restrict__ slots,
                    long long n_tokens, int row_vecs, long long num_slots) {
  for (long long t = blockIdx.x * (long long)blockDim.y + threadIdx.y; t < n_tokens;
       t += (long long)gridDim.x * blockDim.y) {
    const V* ks = k + t * k_stride;
    const V* vs = v + t * v_stride;
    const int slot = slots[t];
    for (int c = threadIdx.x; c < row_vecs; c += blockDim.x) {
      const V kx = ks[c];  // loaded before the slot test: independent of the slot load's latency
      const V vx = vs[c];
      if (slot < 0 || slot >= num_slots) continue;
      k_cache[(long long)slot * row_vecs + c] = kx;
      v_cache[(long long)slot * row_vecs + c] = vx;
    }
  }
}

template <typename V>
void launch(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& slot_mapping, int64_t row_bytes, cudaStream_t stream) {
  const int row_vecs = int(row_bytes / sizeof(V));
  const long long n = k.size(0);
  const int tx = std::clamp((row_vecs + 31) / 32 * 32, 32, 256);
  const int ty = 256 / tx;
  const long long blocks = std::min<long long>((n + ty - 1) / ty, (long long)sm_count(k.device().index()) * 32);
  if (blocks == 0 || row_vecs == 0) return;
  const int64_t es = k.element_size();
  store_kv_kernel<V><<<unsigned(blocks), dim3(tx, ty), 0, stream>>>(
      reinterpret_cast<const V*>(k.data_ptr()), reinterpret_cast<const V*>(v.data_ptr()),
      k.stride(0) * es / int64_t(sizeof(V)), v.stride(0) * es / int64_t(sizeof(V)),
      reinterpret_cast<V*>(k_cache.data_ptr()), reinterpret_cast<V*>(v_cache.data_ptr()),
      slot_mapping.data_ptr<int32_t>(), n, row_vecs, k_cache.size(0) * k_cache.size(1));
}

// A token's [Hkv, D] row must be contiguous; the token stride may be anything.
at::Tensor rows_contiguous(const at::Tensor& t) {
  if ((t.size(2) <= 1 || t.stride(2) == 1) && (t.size(1) <= 1 || t.stride(1) == t.size(2))) return t;
  return t.contiguous();
}

void store_kv(const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  checks::check_store_kv(k_in, v_in, k_cache, v_cache, slot_mapping);
  if (k_in.size(0) == 0 || k_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const at::Tensor k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const int64_t es = k.element_size();
  const int64_t row_bytes = k.size(1) * k.size(2) * es;
  auto fits = [&](int64_t w) {
    return row_bytes % w == 0 && (k.stride(0) * es) % w == 0 && (v.stride(0) * es) % w == 0 &&
           reinterpret_cast<uintptr_t>(k.data_ptr()) % w == 0 && reinterpret_cast<uintptr_t>(v.data_ptr()) % w == 0 &&
           reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % w == 0 &&
           reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % w == 0;
  };
  const cudaStream_t stream = current_stream(k_cache);
  if (fits(16))
    launch<uint4>(k, v, k_cache, v_cache, slot_mapping, row_bytes, stream);
  else if (fits(8))
    launch<uint2>(k, v, k_cache, v_cache, slot_mapping, row_bytes, stream);
  else if (fits(4))
    launch<uint32_t>(k, v, k_cache, v_cache, slot_mapping, row_bytes, stream);
  else
    launch<uint16_t>(k, v, k_cache, v_cache, slot_mapping, row_bytes, stream);
  MINISCHED_CUDA_CHECK("store_kv", cudaGetLastError());
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CUDA, m) { m.impl("store_kv", &store_kv); }

}  // namespace minisched::cuda
