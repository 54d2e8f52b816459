// The register-blocked micro-kernel of packed_linear (packed_linear.cpp), shared with int8_linear's
// many-row path (int8_linear.cpp), which dequantizes int8 weights into the same panel layout.
//
// Layout: a panel is 16 output columns over the whole K, k-major: panel[k * 16 + j] = w[n0 + j, k].
// Every output is one FMA chain over k in order, so a row's result does not depend on the rows
// around it or on how the work is split across threads. The weights are float32, or bfloat16
// (W = uint16_t, the bf16 bits: widened to float32 as they are loaded, a shift by 16), so a bf16
// weight gives the bits of the float32 kernel on the same, rounded, weight.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINISCHED_PACKED_AVX2 1
#endif

namespace minisched::cpu::packed {

using bf16_t = uint16_t;         // the bits of a bfloat16 weight
constexpr int64_t kPanel = 16;   // output columns per panel: two 8-float ymm vectors
constexpr int64_t kMaxRows = 6;  // activation rows per micro-kernel call (6 x 2 accumulators)

#ifdef MINISCHED_PACKED_AVX2
// 8 consecutive weights as float32.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const bf16_t* w) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

// MT activation rows against NP consecutive panels over the whole K. Every loop over m and p is
// fully unrolled: the accumulators must stay in registers (a loop with a runtime index would make
// GCC keep the array on the stack and store it on every k: 1 FMA per cycle instead of 2).
template <int MT, int NP, typename W>
inline void micro(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo, int64_t ncols) {
  __m256 acc[MT][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
  const int64_t panel = K * kPanel;
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NP][2];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      wv[p][0] = load8(w + p * panel + k * kPanel);
      wv[p][1] = load8(w + p * panel + k * kPanel + 8);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[m][p][0] = _mm256_fmadd_ps(xb, wv[p][0], acc[m][p][0]);
        acc[m][p][1] = _mm256_fmadd_ps(xb, wv[p][1], acc[m][p][1]);
      }
    }
  }
  if (ncols == NP * kPanel) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        _mm256_storeu_ps(out + m * ldo + p * kPanel, acc[m][p][0]);
        _mm256_storeu_ps(out + m * ldo + p * kPanel + 8, acc[m][p][1]);
      }
    return;
  }
  alignas(32) float tmp[NP * kPanel];  // the last panel of a matrix whose N is not a multiple of 16
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_store_ps(tmp + p * kPanel, acc[m][p][0]);
      _mm256_store_ps(tmp + p * kPanel + 8, acc[m][p][1]);
    }
    std::copy(tmp, tmp + ncols, out + m * ldo);
  }
}
#else
inline float widen(float w) { return w; }
inline float widen(bf16_t w) {
  const uint32_t bits = uint32_t(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <int MT, int NP, typename W>
inline void micro(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo, int64_t ncols) {
  float acc[MT][NP * kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < NP; ++p)
        for (int64_t j = 0; j < kPanel; ++j)
          acc[m][p * kPanel + j] += x[m * ldx + k] * widen(w[p * K * kPanel + k * kPanel + j]);
  for (int m = 0; m < MT; ++m) std::copy(acc[m], acc[m] + ncols, out + m * ldo);
}
#endif

template <int NP, typename W>
inline void rows_block(int64_t mt, const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo,
                       int64_t ncols) {
  switch (mt) {
    case 1:
      micro<1, NP, W>(x, ldx, w, K, out, ldo, ncols);
      break;
    case 2:
      micro<2, NP, W>(x, ldx, w, K, out, ldo, ncols);
      break;
    case 3:
      micro<3, NP, W>(x, ldx, w, K, out, ldo, ncols);
      break;
    case 4:
      micro<4, NP, W>(x, ldx, w, K, out, ldo, ncols);
      break;
    case 5:
      micro<5, NP, W>(x, ldx, w, K, out, ldo, ncols);
      break;
    case 6:
      micro<6, NP, W>(x, ldx, w, K, out, ldo, ncols);
      break;
    default:
      TORCH_CHECK(false, "packed micro-kernel: internal error: ", mt, " rows in one block");
  }
}

// Panels per micro-kernel call for M activation rows: enough accumulators (MT x NP x 2, at most 12
// of the 16 ymm registers) to cover the FMA latency. One row reads 4 panels at once (8 chains, and
// the FMAs take the weights straight from memory); 2 rows x 2 panels; 3+ rows x 1 panel (6..12).
// 3 rows x 2 panels would need 12 accumulators + 4 weight vectors + a broadcast: it spills.
constexpr int panels_per_call(int64_t m) { return m == 1 ? 4 : (m == 2 ? 2 : 1); }

// Rows [0, M) of x against `np_here` consecutive panels starting at `wp` (ncols valid columns), in
// balanced blocks of at most kMaxRows rows (8 rows: 4 + 4, not 6 + 2, so no block runs on 2 chains).
template <typename W>
inline void panel_rows(const float* x, int64_t M, int64_t ldx, const W* wp, int64_t np_here, int64_t K, float* out,
                       int64_t ldo, int64_t ncols) {
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;
  const int64_t rows = (M + blocks - 1) / blocks;
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const float* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
    switch (np_here) {
      case 4:
        rows_block<4, W>(mt, xm, ldx, wp, K, om, ldo, ncols);
        break;
      case 3:
        rows_block<3, W>(mt, xm, ldx, wp, K, om, ldo, ncols);
        break;
      case 2:
        rows_block<2, W>(mt, xm, ldx, wp, K, om, ldo, ncols);
        break;
      default:
        rows_block<1, W>(mt, xm, ldx, wp, K, om, ldo, ncols);
        break;
    }
  }
}

}  // namespace minisched::cpu::packed
