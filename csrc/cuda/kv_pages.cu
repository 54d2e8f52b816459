// copy_kv_pages / gather_kv_pages / scatter_kv_pages on CUDA: whole pages (all layers, K and V)
// moved by one kernel launch on the current stream, 16-byte vectors, consecutive threads on
// consecutive bytes of a page (coalesced), 4 independent vectors in flight per thread.
//
// The pool is [L, 2, num_pages, page_size, Hkv, D] = 2L "slices" of num_pages pages; a page buffer
// [L, 2, n, ...] is 2L slices of n pages. A buffer on the host (gather's `out`, scatter's `src`)
// goes through a device staging tensor and ONE contiguous copy on the current stream: for pinned
// memory a cudaMemcpyAsync (asynchronous: synchronize before reading a gathered host buffer),
// for pageable memory a synchronous copy. (Not zero-copy through the pinned mapping: a device
// fault there would poison the CUDA context, and PCIe, not the gather, bounds this path.)
//
// Page values of CUDA index tensors are not checked on the host (that would sync): a destination
// page outside [0, num_pages) is skipped; a source page outside it writes NaN into the
// destination page (never an out-of-bounds access).
// Copies run in parallel: copy_kv_pages needs src/dst disjoint and dst distinct (checked for CPU
// index tensors only); on CUDA an overlap is a race, not an error.
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "checks.h"
#include "cuda/torch_glue.cuh"

namespace minisched::cuda {
namespace {

struct MoveParams {
  const void* src;
  void* dst;
  const int32_t* src_idx;  // nullptr: identity (page i of a buffer)
  const int32_t* dst_idx;
  long long src_pages;  // pages per slice in src
  long long dst_pages;
  long long n;          // pages moved per slice
  long long slices;     // 2L
  long long page_vecs;  // vectors per page
  int num_pages;        // pool size (index validation)
};

constexpr int kUnroll = 4;

// One CTA moves one (slice, page) chunk at a time (grid-stride over chunks); its threads stride
// over the chunk's vectors, kUnroll loads in flight before the stores.
template <typename V>
__global__ void __launch_bounds__(256) move_pages_kernel(const MoveParams p, const V nan_fill) {
  const V* __restrict__ src = static_cast<const V*>(p.src);
  V* __restrict__ dst = static_cast<V*>(p.dst);
  const long long chunks = p.slices * p.n;
  const int pv = int(p.page_vecs);
  for (long long chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const long long s = chunk / p.n, i = chunk % p.n;
    const long long sp = p.src_idx ? p.src_idx[i] : i;
    const long long dp = p.dst_idx ? p.dst_idx[i] : i;
    if (p.dst_idx && (dp < 0 || dp >= p.num_pages)) continue;  // uniform over the CTA
    const bool src_ok = !p.src_idx || (sp >= 0 && sp < p.num_pages);
    const V* from = src + (s * p.src_pages + (src_ok ? sp : 0)) * p.page_vecs;
    V* to = dst + (s * p.dst_pages + dp) * p.page_vecs;
    for (int c0 = threadIdx.x; c0 < pv; c0 += blockDim.x * kUnroll) {
      V val[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * blockDim.x;
        if (c < pv) val[u] = src_ok ? from[c] : nan_fill;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * blockDim.x;
        if (c < pv) to[c] = val[u];
      }
    }
  }
}

// 16 bytes of NaN for the element type (repeats every element, so any narrower prefix is too).
template <typename V>
V nan_pattern(at::ScalarType dtype) {
  unsigned char bytes[16];
  for (int i = 0; i < 16; i += 2) {
    uint16_t h = dtype == at::kBFloat16 ? 0x7FC0 : 0x7E00;
    if (dtype == at::kFloat) h = (i % 4 == 0) ? 0x0000 : 0x7FC0;
    if (dtype == at::kDouble) h = (i % 8 == 6) ? 0x7FF8 : 0x0000;
    bytes[i] = h & 0xFF;
    bytes[i + 1] = h >> 8;
  }
  V v;
  std::memcpy(&v, bytes, sizeof(V));
  return v;
}

void launch_move(MoveParams p, int64_t page_bytes, at::ScalarType dtype, int device, cudaStream_t stream,
                 const char* op) {
  auto fits = [&](int64_t w) {
    return page_bytes % w == 0 && reinterpret_cast<uintptr_t>(p.src) % w == 0 &&
           reinterpret_cast<uintptr_t>(p.dst) % w == 0;
  };
  auto go = [&](auto tag) {
    using V = decltype(tag);
    p.page_vecs = page_bytes / int64_t(sizeof(V));
    const long long chunks = p.slices * p.n;
    if (chunks == 0 || p.page_vecs == 0) return;
    TORCH_CHECK_VALUE(p.page_vecs < (int64_t(1) << 31), op, ": page too large (shape)");
    // ~kUnroll vectors per thread per chunk; up to 32 resident CTAs per SM for small pages
    const int threads = int(std::clamp<long long>((p.page_vecs / kUnroll + 31) / 32 * 32, 32, 256));
    const long long blocks = std::min<long long>(chunks, (long long)sm_count(device) * (2048 / threads) * 4);
    move_pages_kernel<V><<<unsigned(blocks), threads, 0, stream>>>(p, nan_pattern<V>(dtype));
  };
  if (fits(16))
    go(uint4{});
  else if (fits(8))
    go(uint2{});
  else if (fits(4))
    go(uint32_t{});
  else
    go(uint16_t{});
  MINISCHED_CUDA_CHECK(op, cudaGetLastError());
}

int64_t page_bytes(const at::Tensor& kv_cache) {
  return kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5) * kv_cache.element_size();
}

void check_pool_on_cuda(const char* op, const at::Tensor& kv_cache) {
  TORCH_CHECK_VALUE(kv_cache.is_cuda(), op, ": kv_cache is on device ", kv_cache.device(),
                    ", expected a CUDA device (the buffer may be on the host)");
}

void copy_kv_pages(const at::Tensor& kv_cache, const at::Tensor& src_pages, const at::Tensor& dst_pages) {
  const char* op = "copy_kv_pages";
  checks::check_copy_kv_pages(kv_cache, src_pages, dst_pages);
  check_pool_on_cuda(op, kv_cache);
  if (src_pages.numel() == 0 || kv_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  MoveParams p{};
  p.src = kv_cache.data_ptr();
  p.dst = kv_cache.data_ptr();
  p.src_idx = src_pages.data_ptr<int32_t>();
  p.dst_idx = dst_pages.data_ptr<int32_t>();
  p.src_pages = p.dst_pages = kv_cache.size(2);
  p.n = src_pages.size(0);
  p.slices = kv_cache.size(0) * 2;
  p.num_pages = int(kv_cache.size(2));
  launch_move(p, page_bytes(kv_cache), kv_cache.scalar_type(), kv_cache.device().index(), current_stream(kv_cache), op);
}

void gather_kv_pages(const at::Tensor& kv_cache, const at::Tensor& pages, const at::Tensor& out) {
  const char* op = "gather_kv_pages";
  checks::check_move_kv_pages(op, "out", kv_cache, pages, out);
  check_pool_on_cuda(op, kv_cache);
  TORCH_CHECK_VALUE(out.is_cuda() ? out.device() == kv_cache.device() : out.device().is_cpu(), op,
                    ": out is on device ", out.device(), ", expected ", kv_cache.device(), " or the (pinned) host");
  if (pages.numel() == 0 || kv_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  at::Tensor staging;  // a host buffer: gather on the device, then one async copy on the stream
  if (!out.is_cuda()) staging = at::empty(out.sizes(), out.options().device(kv_cache.device()));
  void* dst = staging.defined() ? staging.data_ptr() : out.data_ptr();
  MoveParams p{};
  p.src = kv_cache.data_ptr();
  p.dst = dst;
  p.src_idx = pages.data_ptr<int32_t>();
  p.dst_idx = nullptr;
  p.src_pages = kv_cache.size(2);
  p.dst_pages = pages.size(0);
  p.n = pages.size(0);
  p.slices = kv_cache.size(0) * 2;
  p.num_pages = int(kv_cache.size(2));
  launch_move(p, page_bytes(kv_cache), kv_cache.scalar_type(), kv_cache.device().index(), current_stream(kv_cache), op);
  // pinned: cudaMemcpyAsync on the current stream (torch records the pinned block's use);
  // pageable: a synchronous copy
  if (staging.defined()) const_cast<at::Tensor&>(out).copy_(staging, /*non_blocking=*/true);
}

void scatter_kv_pages(const at::Tensor& src, const at::Tensor& kv_cache, const at::Tensor& pages) {
  const char* op = "scatter_kv_pages";
  checks::check_move_kv_pages(op, "src", kv_cache, pages, src);
  check_pool_on_cuda(op, kv_cache);
  TORCH_CHECK_VALUE(src.is_cuda() ? src.device() == kv_cache.device() : src.device().is_cpu(), op,
                    ": src is on device ", src.device(), ", expected ", kv_cache.device(), " or the (pinned) host");
  if (pages.numel() == 0 || kv_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  at::Tensor staging;  // a host buffer: one async copy to the device on the stream, then scatter
  if (!src.is_cuda()) {
    staging = at::empty(src.sizes(), src.options().device(kv_cache.device()));
    staging.copy_(src, /*non_blocking=*/true);
  }
  const void* from = staging.defined() ? staging.data_ptr() : src.data_ptr();
  MoveParams p{};
  p.src = from;
  p.dst = kv_cache.data_ptr();
  p.src_idx = nullptr;
  p.dst_idx = pages.data_ptr<int32_t>();
  p.src_pages = pages.size(0);
  p.dst_pages = kv_cache.size(2);
  p.n = pages.size(0);
  p.slices = kv_cache.size(0) * 2;
  p.num_pages = int(kv_cache.size(2));
  launch_move(p, page_bytes(kv_cache), kv_cache.scalar_type(), kv_cache.device().index(), current_stream(kv_cache), op);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CUDA, m) {
  m.impl("copy_kv_pages", &copy_kv_pages);
  m.impl("gather_kv_pages", &gather_kv_pages);
  m.impl("scatter_kv_pages", &scatter_kv_pages);
}

}  // namespace minisched::cuda
