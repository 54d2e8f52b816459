// The AVX-512 variant of int8_linear's micro-kernel (int8_microkernel.h has the ymm ones and the
// layout): a 16-column panel's pair of input channels is one zmm register of int16 (vpmovsxbw from
// 32 bytes), vpdpwssd sums 32 products per instruction into 16 int32 lanes, and up to 24 of the 32
// registers hold int32 accumulators (8 rows x 3 panels, 6 x 4, 1 x 8). The float operations are the
// ymm variants', in the same order: the same bits. Compiled for AVX-512 after every header (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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
constexpr int64_t kInt32Block = 256;  // as int8_microkernel.h: no int32 overflow

// acc += the pairwise int16 products of x and w, in place. Inline asm: GCC 12 compiles the intrinsic
// with a register copy of every accumulator and a store of it to the stack per instruction.
inline void dot_pairs(__m512i& acc, __m512i x, __m512i w) { asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w)); }

template <int MT, int NP>
void micro(const int16_t* q, int64_t ldq, const float* sx, const int8_t* w, const float* ws, int64_t K, int64_t G,
           float* out, int64_t ldo, int64_t ncols) {
  const int64_t ng = K / G, wpanel = K * kPanel, spanel = ng * kPanel;
  alignas(64) float facc[MT][NP][kPanel] = {};
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t c0 = g * G; c0 < (g + 1) * G; c0 += kInt32Block) {
      const int64_t c1 = std::min((g + 1) * G, c0 + kInt32Block);
      __m512i acc[MT][NP];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_si512();
      for (int64_t k = c0; k < c1; k += 2) {
        __m512i wv[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          wv[p] =
              _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * wpanel + k * kPanel)));
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          int32_t pair;
          std::memcpy(&pair, q + m * ldq + k, sizeof(pair));
          const __m512i xb = _mm512_set1_epi32(pair);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) dot_pairs(acc[m][p], xb, wv[p]);
        }
      }
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const __m512 s = _mm512_loadu_ps(ws + p * spanel + g * kPanel);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m)
          _mm512_store_ps(facc[m][p], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][p]), s, _mm512_load_ps(facc[m][p])));
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const __m512 scale = _mm512_set1_ps(sx[m]);
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      _mm512_mask_storeu_ps(out + m * ldo + p * kPanel, panel_mask(ncols, p),
                            _mm512_mul_ps(_mm512_load_ps(facc[m][p]), scale));
  }
}

}  // namespace

void int8_panel_rows(const int16_t* q, int64_t M, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                     int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols) {
  const int64_t rows = packed_rows_per_block512(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const int16_t* qm = q + m0 * ldq;
    const float* sm = sx + m0;
    float* om = out + m0 * ldo;
    with_block_shape(mt, np_here, [&]<int MT, int NP>() { micro<MT, NP>(qm, ldq, sm, w, ws, K, G, om, ldo, ncols); });
  }
}

}  // namespace minisched::cpu::avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::int8_panel_rows(const int16_t*, int64_t, int64_t, const float*, const int8_t*,
                                             const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t) {
  __builtin_trap();
}
#endif
