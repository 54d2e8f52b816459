// int8_linear on the CPU: out[m, n] = sum_k x[m, k] * w_q[n, k] * scales[n, k / G]
// (weight-only int8, symmetric, one float32 scale per group of G input channels; G = K / scales.size(1)).
//
// Why: single-stream decode on the CPU is bound by reading the weights (135M fp32 = 540 MB per
// token for SmolLM2); int8 reads a quarter of that. Two paths:
//   * few rows (decode, M <= 16): a fused kernel that converts int8 -> fp32 in registers,
//     applies the group scale once per 8 weights and FMAs against up to 4 activation rows, so each
//     weight byte is read once per 4 rows and never written back as fp32;
//   * many rows (batched decode, prefill): the work is compute-bound, so each task dequantizes one
//     16-column panel of the weight into a small fp32 buffer in packed_linear's layout and runs
//     packed_linear's register-blocked micro-kernel (packed_microkernel.h) over all the rows. The
//     buffer stays in L1/L2; the conversion costs 16 x K per panel against 16 x K x M FMAs.
//     (It replaced a dequantize + ATen sgemm path that ran 0.77-0.86x of packed fp32 at 32-64 rows.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINISCHED_INT8_AVX2 1
#endif

#include "checks.h"
#include "cpu/packed_microkernel.h"

namespace minisched::cpu {
namespace {

// From this many rows on, dequantized panels + the packed micro-kernel: the fused kernel converts each
// weight row once per 8 activation rows (benchmarks/kernels/bench_int8.py, benchmarks/RESULTS.md).
constexpr int64_t kGemmRows = 17;
using packed::kPanel;

#ifdef MINISCHED_INT8_AVX2
inline __m256 load8_scaled(const int8_t* w, __m256 scale) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), scale);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight row n against MT activation rows: the row is converted once per MT rows. U independent
// 8-wide accumulators per activation row keep the FMA pipes busy (U = 4, 2, 1 for MT <= 2, 4, 8:
// at most 8 accumulators + temporaries in the 16 ymm registers). G % 32 == 0 makes each group a
// whole number of U*8 steps.
template <int MT>
inline void dot_row(const float* x, int64_t ldx, const int8_t* w, const float* s, int64_t K, int64_t G, float* out,
                    int64_t ldo) {
  constexpr int U = MT <= 2 ? 4 : (MT <= 4 ? 2 : 1);
  __m256 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const __m256 scale = _mm256_set1_ps(s[g0 / G]);
    for (int64_t k = g0; k < g0 + G; k += 8 * U) {
      __m256 wv[U];
      for (int u = 0; u < U; ++u) wv[u] = load8_scaled(w + k + 8 * u, scale);
      for (int m = 0; m < MT; ++m)
        for (int u = 0; u < U; ++u)
          acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * u), wv[u], acc[m][u]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 t = acc[m][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[m][u]);
    out[m * ldo] = hsum(t);
  }
}

// An 8 x 8 block of floats transposed in registers: r[i][j] <- r[j][i].
inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Weight rows n0 .. n0 + 15 (zero past N) to one fp32 panel, panel[k * 16 + j] = w[n0 + j, k] *
// scale: 8 rows x 8 weights converted and scaled per step, then transposed in registers. G % 32 == 0,
// so the 8 weights of a step share their group's scale.
inline void dequant_panel(const int8_t* w, const float* s, int64_t N, int64_t K, int64_t G, int64_t n0, float* panel) {
  const int64_t ng = K / G;
  for (int64_t jh = 0; jh < kPanel; jh += 8) {
    const int64_t rows = std::min<int64_t>(8, N - n0 - jh);  // may be <= 0: a zero half
    for (int64_t k = 0; k < K; k += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t n = n0 + jh + i;
        r[i] = i < rows ? load8_scaled(w + n * K + k, _mm256_set1_ps(s[n * ng + k / G])) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kPanel + jh, r[i]);
    }
  }
}
#else
inline void dequant_panel(const int8_t* w, const float* s, int64_t N, int64_t K, int64_t G, int64_t n0, float* panel) {
  const int64_t ng = K / G;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < kPanel; ++j) {
      const int64_t n = n0 + j;
      panel[k * kPanel + j] = n < N ? static_cast<float>(w[n * K + k]) * s[n * ng + k / G] : 0.f;
    }
}

template <int MT>
inline void dot_row(const float* x, int64_t ldx, const int8_t* w, const float* s, int64_t K, int64_t G, float* out,
                    int64_t ldo) {
  for (int m = 0; m < MT; ++m) {
    float total = 0.f;
    for (int64_t g0 = 0; g0 < K; g0 += G) {
      float part = 0.f;
      for (int64_t k = g0; k < g0 + G; ++k) part += x[m * ldx + k] * static_cast<float>(w[k]);
      total += part * s[g0 / G];
    }
    out[m * ldo] = total;
  }
}
#endif

// Rows [n0, n1) of the output for all M activation rows, eight activation rows at a time.
void fused_rows(const float* x, int64_t M, int64_t ldx, const int8_t* w, const float* s, int64_t K, int64_t G,
                float* out, int64_t N, int64_t n0, int64_t n1) {
  const int64_t ng = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    const float* sn = s + n * ng;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) dot_row<8>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
    switch (M - m) {
      case 7:
        dot_row<7>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      case 6:
        dot_row<6>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      case 5:
        dot_row<5>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      case 4:
        dot_row<4>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      case 3:
        dot_row<3>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      case 2:
        dot_row<2>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      case 1:
        dot_row<1>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N);
        break;
      default:
        break;
    }
  }
}

// All M rows, one dequantized 16-column panel at a time (a task per panel; the panel is reused by
// every row block while it is in cache).
void panel_gemm(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& scales, const at::Tensor& out) {
  const int64_t M = x.size(0), N = w_q.size(0), K = w_q.size(1), G = K / scales.size(1);
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  const float* s = scales.const_data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t P = (N + kPanel - 1) / kPanel, ldx = x.stride(0);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(static_cast<size_t>(K * kPanel));
    for (int64_t p = p0; p < p1; ++p) {
      dequant_panel(w, s, N, K, G, p * kPanel, panel.data());
      packed::panel_rows(xp, M, ldx, panel.data(), 1, K, o + p * kPanel, N, std::min(kPanel, N - p * kPanel));
    }
  });
}

void int8_linear(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& scales, const at::Tensor& out) {
  checks::check_int8_linear(x, w_q, scales, out);
  const int64_t M = x.size(0), N = w_q.size(0), K = w_q.size(1);
  if (M == 0 || N == 0) return;
  if (M >= kGemmRows) {
    panel_gemm(x, w_q, scales, out);
    return;
  }
  const int64_t G = K / scales.size(1);
  const float* xp = x.const_data_ptr<float>();
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  const float* s = scales.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  // ~32 KB of weights per task: enough work to amortize a thread wake-up, small enough to split
  // the 576-row projections of a 135M model across cores.
  const int64_t grain = std::max<int64_t>(1, 32768 / K);
  at::parallel_for(0, N, grain,
                   [&](int64_t n0, int64_t n1) { fused_rows(xp, M, x.stride(0), w, s, K, G, o, N, n0, n1); });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("int8_linear", &int8_linear); }

}  // namespace minisched::cpu
