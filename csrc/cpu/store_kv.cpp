// store_kv on the CPU: write N tokens' K/V [N, Hkv, D] into one layer's paged caches
// [num_pages, page_size, Hkv, D] at slot_mapping[t] (slot = page * page_size + offset; < 0 skips).
// k and v may be strided views (e.g. slices of a fused qkv projection); the caches are contiguous.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

#include "checks.h"
#include "cpu/thread_pool.h"

namespace minisched::cpu {
namespace {

// Copy token t of src [N, Hkv, D] (any strides) to the contiguous row block dst [Hkv, D].
void copy_token(const at::Tensor& src, int64_t t, char* dst, int64_t esize) {
  const int64_t hkv = src.size(1), d = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const char* base = static_cast<const char*>(src.const_data_ptr()) + t * s0 * esize;
  if (s2 == 1 && s1 == d) {
    std::memcpy(dst, base, hkv * d * esize);
  } else if (s2 == 1) {
    for (int64_t h = 0; h < hkv; ++h) std::memcpy(dst + h * d * esize, base + h * s1 * esize, d * esize);
  } else {
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t i = 0; i < d; ++i) std::memcpy(dst + (h * d + i) * esize, base + (h * s1 + i * s2) * esize, esize);
  }
}

void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  checks::check_store_kv(k, v, k_cache, v_cache, slot_mapping);
  const int64_t n = k.size(0);
  if (n == 0) return;
  const int64_t esize = k_cache.element_size();
  const int64_t row = k_cache.size(2) * k_cache.size(3) * esize;  // bytes of one slot
  const int32_t* slots = slot_mapping.const_data_ptr<int32_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // Tokens are independent (two tokens sharing a slot is a caller bug; within one chunk of
  // 256 tokens the last one wins, as in the reference).
  parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      copy_token(k, t, kc + slot * row, esize);
      copy_token(v, t, vc + slot * row, esize);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("store_kv", &store_kv); }

}  // namespace minisched::cpu
