// rms_norm on the CPU (float32): out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * weight, optionally after the
// residual add x[m] += delta[m] (written back to x: the residual stream).
//
// Why: ATen's CPU rms_norm is a composite of ~6 kernels (pow, mean, add, rsqrt, mul, mul), 20-300 us per
// call on SmolLM2's [1..64, 576] rows, ~7 % of a decode step at B=64 (61 calls per step, plus the 60
// residual adds). One pass per row here: the sum of squares in 8-wide partial sums, then the scaled
// product. A row's result does not depend on the other rows (batch-invariant). AVX-512 machines run the
// 16-wide variant in rms_norm_avx512.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINISCHED_RMS_AVX2 1
#endif

#include "checks.h"
#include "cpu/thread_pool.h"
#include "cpu/cpu_isa.h"
#include "cpu/isa_kernels.h"

namespace minisched::cpu {
namespace {

// One row: x += delta (when given), then out = x * inv_rms * w.
inline void norm_row(float* x, const float* delta, const float* w, float eps, float* out, int64_t D) {
  int64_t k = 0;
#ifdef MINISCHED_RMS_AVX2
  __m256 ss = _mm256_setzero_ps();
  for (; k + 8 <= D; k += 8) {
    __m256 v = _mm256_loadu_ps(x + k);
    if (delta != nullptr) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(delta + k));
      _mm256_storeu_ps(x + k, v);
    }
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(ss), _mm256_extractf128_ps(ss, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float sum = _mm_cvtss_f32(h);
#else
  float sum = 0.f;
#endif
  for (; k < D; ++k) {
    if (delta != nullptr) x[k] += delta[k];
    sum += x[k] * x[k];
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
  k = 0;
#ifdef MINISCHED_RMS_AVX2
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; k + 8 <= D; k += 8)
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), vinv)));
#endif
  for (; k < D; ++k) out[k] = w[k] * (x[k] * inv);
}

void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
              const at::Tensor& out) {
  checks::check_rms_norm(x, delta, weight, eps, out);
  const int64_t M = x.size(0), D = x.size(1);
  if (M == 0 || D == 0) return;
  float* xp = x.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->const_data_ptr<float>() : nullptr;
  const float* w = weight.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // ~64K elements per task: below that a thread wake-up costs more than the row work.
  const int64_t grain = std::max<int64_t>(1, 65536 / D);
  const bool wide = use_avx512();
  parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    if (wide) return avx512::rms_norm_rows(xp, dp, w, e, o, D, m0, m1);
    for (int64_t m = m0; m < m1; ++m) norm_row(xp + m * D, dp == nullptr ? nullptr : dp + m * D, w, e, o + m * D, D);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("rms_norm", &rms_norm); }

}  // namespace minisched::cpu
