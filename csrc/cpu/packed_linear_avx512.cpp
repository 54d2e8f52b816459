// The AVX-512 variant of packed_linear's micro-kernel (packed_microkernel.h has the AVX2 one and
// the layout). A 16-column panel is one zmm register, so each FMA does 16 columns, and the 32
// registers hold up to 8 rows x 3 panels (or 6 x 4) of accumulators. Every output is still one FMA
// chain over k in order, started from zero: the results are the same bits as the AVX2 variant's,
// whatever the batch around a row or the thread count.
//
// Compiled for AVX-512 by the pragma below, after every header: see cpu_isa.h for why.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/avx512_blocks.h"
#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512_undefined_ps (PR 105593)

namespace minisched::cpu::avx512 {
namespace {

constexpr int64_t kPanel = 16;

// 16 consecutive weights as float32 (a bf16 weight: its bits shifted into the top half).
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
}

// MT activation rows against NP consecutive panels over the whole K (loops fully unrolled: the
// accumulators stay in registers).
template <int MT, int NP, typename W>
inline void micro(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo, int64_t ncols) {
  __m512 acc[MT][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const int64_t panel = K * kPanel;
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) wv[p] = load16(w + p * panel + k * kPanel);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xb, wv[p], acc[m][p]);
    }
  }
  if (ncols == NP * kPanel) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * ldo + p * kPanel, acc[m][p]);
    return;
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const __mmask16 mask = panel_mask(ncols, p);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + m * ldo + p * kPanel, mask, acc[m][p]);
  }
}

template <typename W>
void panel_rows(const float* x, int64_t M, int64_t ldx, const W* wp, int64_t np_here, int64_t K, float* out,
                int64_t ldo, int64_t ncols) {
  const int64_t rows = packed_rows_per_block512(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const float* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
    with_block_shape(mt, np_here, [&]<int MT, int NP>() { micro<MT, NP, W>(xm, ldx, wp, K, om, ldo, ncols); });
  }
}

}  // namespace

void packed_panel_rows(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t np_here, int64_t K, float* out,
                       int64_t ldo, int64_t ncols) {
  panel_rows(x, M, ldx, wp, np_here, K, out, ldo, ncols);
}

void packed_panel_rows(const float* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t np_here, int64_t K,
                       float* out, int64_t ldo, int64_t ncols) {
  panel_rows(x, M, ldx, wp, np_here, K, out, ldo, ncols);
}

}  // namespace minisched::cpu::avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else  // not x86: never called (isa() is never avx512 there)
void minisched::cpu::avx512::packed_panel_rows(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*,
                                               int64_t, int64_t) {
  __builtin_trap();
}
void minisched::cpu::avx512::packed_panel_rows(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                               float*, int64_t, int64_t) {
  __builtin_trap();
}
#endif
