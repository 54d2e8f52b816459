// The register-blocked micro-kernel of int8_linear on ymm registers, in two flavours: plain AVX2
// (vpmaddwd + vpaddd; int8_linear.cpp) and AVX-VNNI (vpdpwssd, the same sum in one instruction;
// int8_linear_avx2vnni.cpp, which includes this file inside its target pragma). The AVX-512 variant
// is int8_linear_avx512.cpp.
//
// Layout (ops.pack_int8_weight): a panel is 16 output columns; for each pair of input channels
// (k, k + 1) it holds 32 bytes, column j's two weights side by side -- sign-extended to int16, one
// 32-bit lane per column, the operand of the int16 dot-product instructions. Activations arrive as
// int16 rows (quantized per row by int8_linear.cpp), each pair (q[k], q[k + 1]) broadcast as one
// 32-bit lane. Products are summed exactly in int32 over at most kInt32Block input channels of one
// scale group, converted to float32 and accumulated with the group's scale (an FMA), in k order; the
// row's scale multiplies the result. Every variant does the same float operations in the same order:
// their outputs are the same bits, and a row's output does not depend on the rows around it.
//
// Everything here has internal linkage: each translation unit that includes it gets its own copy,
// compiled for its own ISA (cpu_isa.h says why that matters).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace minisched::cpu::int8k {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kInt32Block = 256;  // 256 x 32767 x 127 < 2^31: an int32 sum cannot overflow
constexpr int64_t kMaxRows = 4;       // rows per micro-kernel call on ymm

constexpr int64_t rows_per_block(int64_t m) {
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  return blocks == 0 ? 1 : (m + blocks - 1) / blocks;
}

// Panels per call: 2 for one or two rows (4 or 8 int32 accumulators), 1 from three rows on.
constexpr int panels_per_call(int64_t m) { return rows_per_block(m) <= 2 ? 2 : 1; }

inline __m256i broadcast_pair(const int16_t* q) {
  int32_t pair;
  std::memcpy(&pair, q, sizeof(pair));
  return _mm256_set1_epi32(pair);
}

// acc += the pairwise int16 products of x and w. VNNI: inline asm, in place (GCC 12 compiles the
// intrinsic with a register copy of every accumulator and a store of it to the stack).
template <bool kVnni>
inline __m256i dot_pairs(__m256i acc, __m256i x, __m256i w) {
  if constexpr (kVnni) {
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
  }
}

// MT activation rows against NP consecutive panels over the whole K.
template <bool kVnni, int MT, int NP>
inline void micro(const int16_t* q, int64_t ldq, const float* sx, const int8_t* w, const float* ws, int64_t K,
                  int64_t G, float* out, int64_t ldo, int64_t ncols) {
  const int64_t ng = K / G, wpanel = K * kPanel, spanel = ng * kPanel;
  alignas(32) float facc[MT][NP * kPanel] = {};
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t c0 = g * G; c0 < (g + 1) * G; c0 += kInt32Block) {
      const int64_t c1 = std::min((g + 1) * G, c0 + kInt32Block);
      __m256i acc[MT][NP][2];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_si256();
      for (int64_t k = c0; k < c1; k += 2) {
        __m256i wv[NP][2];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const int8_t* src = w + p * wpanel + k * kPanel;  // pair k / 2: 32 bytes
          wv[p][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
          wv[p][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m256i xb = broadcast_pair(q + m * ldq + k);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            acc[m][p][0] = dot_pairs<kVnni>(acc[m][p][0], xb, wv[p][0]);
            acc[m][p][1] = dot_pairs<kVnni>(acc[m][p][1], xb, wv[p][1]);
          }
        }
      }
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256 s = _mm256_loadu_ps(ws + p * spanel + g * kPanel + 8 * h);
#pragma GCC unroll 8
          for (int m = 0; m < MT; ++m) {
            float* f = facc[m] + p * kPanel + 8 * h;
            _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][p][h]), s, _mm256_load_ps(f)));
          }
        }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const __m256 scale = _mm256_set1_ps(sx[m]);
    for (int64_t j = 0; j < NP * kPanel; j += 8)
      _mm256_store_ps(facc[m] + j, _mm256_mul_ps(_mm256_load_ps(facc[m] + j), scale));
    std::copy(facc[m], facc[m] + ncols, out + m * ldo);
  }
}

template <bool kVnni, int NP>
inline void rows_block(int64_t mt, const int16_t* q, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                       int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols) {
  switch (mt) {
    case 1:
      return micro<kVnni, 1, NP>(q, ldq, sx, w, ws, K, G, out, ldo, ncols);
    case 2:
      return micro<kVnni, 2, NP>(q, ldq, sx, w, ws, K, G, out, ldo, ncols);
    case 3:
      return micro<kVnni, 3, NP>(q, ldq, sx, w, ws, K, G, out, ldo, ncols);
    default:
      return micro<kVnni, 4, NP>(q, ldq, sx, w, ws, K, G, out, ldo, ncols);
  }
}

// Rows [0, M) against np_here (<= panels_per_call(M)) panels at w / ws, ncols valid columns.
template <bool kVnni>
inline void panel_rows(const int16_t* q, int64_t M, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                       int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols) {
  const int64_t rows = rows_per_block(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    if (np_here == 2)
      rows_block<kVnni, 2>(mt, q + m0 * ldq, ldq, sx + m0, w, ws, K, G, out + m0 * ldo, ldo, ncols);
    else
      rows_block<kVnni, 1>(mt, q + m0 * ldq, ldq, sx + m0, w, ws, K, G, out + m0 * ldo, ldo, ncols);
  }
}

}  // namespace
}  // namespace minisched::cpu::int8k
