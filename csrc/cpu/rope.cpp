// rope on the CPU (float32): half-rotation rotary embedding of x [N, H, D] (rows may be strided: the
// q or k columns of the fused qkv projection) into a contiguous out [N, H, D], with cos, sin [N, D/2]:
//   out[.., j]       = x[.., j] * cos[j] - x[.., j + D/2] * sin[j]
//   out[.., j + D/2] = x[.., j + D/2] * cos[j] + x[.., j] * sin[j]          (j < D/2)
// Why: torch's x * cos + rotate_half(x) * sin is 4-6 kernels and two temporaries per layer, and the
// attention kernels then want q contiguous (one more copy): ~4 % of a 512-token prefill on SmolLM2.
// One pass here, writing the layout the attention and store_kv take.
// Each product is rounded before the sum (no FMA contraction: the pragma below), so the result is
// bitwise torch's x * cos + rotate_half(x) * sin in float32, on every ISA variant.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX2__)
#include <immintrin.h>
#define MINISCHED_ROPE_AVX2 1
#endif

#include "checks.h"
#include "cpu/thread_pool.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace minisched::cpu {
namespace {

// One head: x and out point at its D values; c, s at the token's D/2 cos and sin values.
inline void rope_head(const float* x, const float* c, const float* s, float* out, int64_t half) {
  int64_t j = 0;
#ifdef MINISCHED_ROPE_AVX2
  for (; j + 8 <= half; j += 8) {
    const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + half + j);
    const __m256 cj = _mm256_loadu_ps(c + j), sj = _mm256_loadu_ps(s + j);
    _mm256_storeu_ps(out + j, _mm256_sub_ps(_mm256_mul_ps(a, cj), _mm256_mul_ps(b, sj)));
    _mm256_storeu_ps(out + half + j, _mm256_add_ps(_mm256_mul_ps(b, cj), _mm256_mul_ps(a, sj)));
  }
#endif
  for (; j < half; ++j) {
    const float a = x[j], b = x[half + j];
    out[j] = a * c[j] - b * s[j];
    out[half + j] = b * c[j] + a * s[j];
  }
}

void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out) {
  checks::check_rope(x, cos, sin, out);
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  if (N == 0 || H == 0 || D == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t sn = x.stride(0), sh = x.stride(1);
  // ~32K outputs per task: below that a thread wake-up costs more than the work.
  const int64_t grain = std::max<int64_t>(1, 32768 / (H * D));
  parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t h = 0; h < H; ++h)
        rope_head(xp + n * sn + h * sh, cp + n * half, sp + n * half, o + (n * H + h) * D, half);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("rope", &rope); }

}  // namespace minisched::cpu

#pragma GCC pop_options
