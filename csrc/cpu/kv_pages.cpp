// Whole-page KV movement on the CPU, all layers, K and V, over the pool
// kv_cache [L, 2, num_pages, page_size, Hkv, D]:
//   copy_kv_pages    kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]]
//   gather_kv_pages  out[:, :, i] = kv_cache[:, :, pages[i]]      (out [L, 2, n, page_size, Hkv, D])
//   scatter_kv_pages kv_cache[:, :, pages[i]] = src[:, :, i]
// Work is split over the 2L (layer, K/V) slices; inside a slice pages go in order, so repeated
// or chained page indices behave exactly as the reference's sequential loop.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

#include "checks.h"
#include "cpu/thread_pool.h"

namespace minisched::cpu {
namespace {

// For each of the 2L slices, copy n pages: dst_page(i) <- src_page(i) (page indices inside the
// slice), where a slice of the pool holds num_pages pages and a slice of a buffer holds n.
template <typename SrcIdx, typename DstIdx>
void move_pages(const char* src, int64_t src_pages_per_slice, char* dst, int64_t dst_pages_per_slice, int64_t slices,
                int64_t n, int64_t page_bytes, SrcIdx src_idx, DstIdx dst_idx) {
  if (n == 0 || slices == 0 || page_bytes == 0) return;
  // Split slices (each in page order) first; a single-slice pool still moves in order.
  parallel_for(0, slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const char* sb = src + s * src_pages_per_slice * page_bytes;
      char* db = dst + s * dst_pages_per_slice * page_bytes;
      for (int64_t i = 0; i < n; ++i) {
        const char* from = sb + src_idx(i) * page_bytes;
        char* to = db + dst_idx(i) * page_bytes;
        if (from != to) std::memcpy(to, from, page_bytes);
      }
    }
  });
}

int64_t page_bytes(const at::Tensor& kv_cache) {
  return kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5) * kv_cache.element_size();
}

void copy_kv_pages(const at::Tensor& kv_cache, const at::Tensor& src_pages, const at::Tensor& dst_pages) {
  checks::check_copy_kv_pages(kv_cache, src_pages, dst_pages);
  const int32_t* src = src_pages.const_data_ptr<int32_t>();
  const int32_t* dst = dst_pages.const_data_ptr<int32_t>();
  char* pool = static_cast<char*>(kv_cache.data_ptr());
  const int64_t np = kv_cache.size(2);
  move_pages(
      pool, np, pool, np, kv_cache.size(0) * 2, src_pages.size(0), page_bytes(kv_cache),
      [&](int64_t i) { return int64_t(src[i]); }, [&](int64_t i) { return int64_t(dst[i]); });
}

void gather_kv_pages(const at::Tensor& kv_cache, const at::Tensor& pages, const at::Tensor& out) {
  checks::check_move_kv_pages("gather_kv_pages", "out", kv_cache, pages, out);
  checks::check_device("gather_kv_pages", "out", out, kv_cache.device());
  const int32_t* idx = pages.const_data_ptr<int32_t>();
  const int64_t n = pages.size(0);
  move_pages(
      static_cast<const char*>(kv_cache.const_data_ptr()), kv_cache.size(2), static_cast<char*>(out.data_ptr()), n,
      kv_cache.size(0) * 2, n, page_bytes(kv_cache), [&](int64_t i) { return int64_t(idx[i]); },
      [](int64_t i) { return i; });
}

void scatter_kv_pages(const at::Tensor& src, const at::Tensor& kv_cache, const at::Tensor& pages) {
  checks::check_move_kv_pages("scatter_kv_pages", "src", kv_cache, pages, src);
  checks::check_device("scatter_kv_pages", "src", src, kv_cache.device());
  const int32_t* idx = pages.const_data_ptr<int32_t>();
  const int64_t n = pages.size(0);
  move_pages(
      static_cast<const char*>(src.const_data_ptr()), n, static_cast<char*>(kv_cache.data_ptr()), kv_cache.size(2),
      kv_cache.size(0) * 2, n, page_bytes(kv_cache), [](int64_t i) { return i; },
      [&](int64_t i) { return int64_t(idx[i]); });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) {
  m.impl("copy_kv_pages", &copy_kv_pages);
  m.impl("gather_kv_pages", &gather_kv_pages);
  m.impl("scatter_kv_pages", &scatter_kv_pages);
}

}  // namespace minisched::cpu
