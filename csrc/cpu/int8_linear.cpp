// int8_linear on the CPU: out[m, n] = sum_k x[m, k] * w_q[n, k] * scales[n, k / G]
// (weight-only int8, symmetric, one float32 scale per group of G input channels; G = K / scales.size(1)).
//
// Why: single-stream decode on the CPU is bound by reading the weights (135M fp32 = 540 MB per
// token for SmolLM2); int8 reads a quarter of that. Two paths:
//   * few rows (decode, M <= 16): a fused kernel that converts int8 -> fp32 in registers,
//     applies the group scale once per 8 weights and FMAs against up to 4 activation rows, so each
//     weight byte is read once per 4 rows and never written back as fp32;
//   * many rows (prefill): the work is compute-bound, so blocks of the weight are dequantized into
//     a small fp32 buffer and handed to ATen's sgemm, which is faster than anything hand-written here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINISCHED_INT8_AVX2 1
#endif

#include "checks.h"

namespace minisched::cpu {
namespace {

// From this many rows on, dequantize + sgemm: the fused kernel converts each weight row once per 8
// activation rows, so past two such tiles sgemm wins (benchmarks/bench_int8.py, RESULTS.md).
constexpr int64_t kGemmRows = 17;
constexpr int64_t kDequantBlock = 1024;  // weight rows per dequantized block (K = 576: 2.3 MB of fp32)

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
inline void dot_row(const float* x, int64_t ldx, const int8_t* w, const float* s, int64_t K, int64_t G,
                    float* out, int64_t ldo) {
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

// One weight row to fp32: 8 weights per step, the group's scale broadcast once per group.
inline void dequant_row(const int8_t* w, const float* s, int64_t K, int64_t G, float* out) {
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const __m256 scale = _mm256_set1_ps(s[g0 / G]);
    for (int64_t k = g0; k < g0 + G; k += 8) _mm256_storeu_ps(out + k, load8_scaled(w + k, scale));
  }
}
#else
inline void dequant_row(const int8_t* w, const float* s, int64_t K, int64_t G, float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>(w[k]) * s[k / G];
}

template <int MT>
inline void dot_row(const float* x, int64_t ldx, const int8_t* w, const float* s, int64_t K, int64_t G,
                    float* out, int64_t ldo) {
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
      case 7: dot_row<7>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      case 6: dot_row<6>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      case 5: dot_row<5>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      case 4: dot_row<4>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      case 3: dot_row<3>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      case 2: dot_row<2>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      case 1: dot_row<1>(x + m * ldx, ldx, wn, sn, K, G, out + m * N + n, N); break;
      default: break;
    }
  }
}

void dequant_gemm(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& scales, const at::Tensor& out) {
  const int64_t N = w_q.size(0), K = w_q.size(1), ng = scales.size(1), G = K / ng;
  const int8_t* w = w_q.const_data_ptr<int8_t>();
  const float* s = scales.const_data_ptr<float>();
  at::Tensor buf = at::empty({std::min(N, kDequantBlock), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += kDequantBlock) {
    const int64_t nb = std::min(kDequantBlock, N - n0);
    float* b = buf.data_ptr<float>();
    at::parallel_for(0, nb, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequant_row(w + (n0 + r) * K, s + (n0 + r) * ng, K, G, b + r * K);
    });
    if (nb == N) {
      at::mm_out(const_cast<at::Tensor&>(out), x, buf.t());
    } else {  // sgemm into a contiguous block, then into its columns of out
      out.narrow(1, n0, nb).copy_(at::mm(x, buf.narrow(0, 0, nb).t()));
    }
  }
}

void int8_linear(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& scales, const at::Tensor& out) {
  checks::check_int8_linear(x, w_q, scales, out);
  const int64_t M = x.size(0), N = w_q.size(0), K = w_q.size(1);
  if (M == 0 || N == 0) return;
  if (M >= kGemmRows) {
    dequant_gemm(x, w_q, scales, out);
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
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    fused_rows(xp, M, x.stride(0), w, s, K, G, o, N, n0, n1);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("int8_linear", &int8_linear); }

}  // namespace minisched::cpu
