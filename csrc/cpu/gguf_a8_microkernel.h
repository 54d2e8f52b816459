// gguf_a8_linear's arithmetic (gguf_a8_linear.cpp), its layout and its ymm micro-kernel in two flavours:
// plain AVX2 (vpmaddubsw + vpmaddwd; gguf_a8_linear.cpp) and AVX-VNNI (vpdpbusd on ymm;
// gguf_a8_linear_avx2vnni.cpp, which includes this file inside its target pragma). The AVX-512 variant is
// gguf_a8_linear_avx512.cpp.
//
// Activations (A8Rows, isa_kernels.h): each block of 32 channels of a row rounded to int8 xq with one
// float32 scale dx (reference.quantize_a8), and sq = sum of its xq. Weights: pack_gguf_weight's
// panel-blocks (gguf_microkernel.h: 16 rows x 32 channels, the rows' fp16 d, then m for Q4_1) with the
// quants in 32-bit lanes, one row per lane (ops.pack_gguf_a8_weight): 64 bytes per group g,
//   Q4 (4 groups): lane r = row r's qs[4g .. 4g + 3]: channels 4g.. in the low nibbles, 16 + 4g.. in the high
//   Q8 (8 groups): lane r = row r's q[4g .. 4g + 3] (signed)
// so one vpdpbusd multiplies 4 channels of 16 rows (zmm; 8 rows on ymm) by one broadcast dword of xq.
//
// Per row, column and block b, every variant computes the exact integer s = sum_c w_c * xq_c (w_c the
// signed quant: q - 8 for Q4_0, q for Q4_1, q for Q8_0; |s| < 2^24, so float(s) is exact) and then, in
// block order from zero, acc = fma(d * dx_b, float(s), acc) and for Q4_1 acc = fma(m, dx_b * sq_b, acc):
// the same float operations in the same order on every ISA, so the variants give the same bits and a
// row's result does not depend on the rows beside it. Unsigned operands for vpdpbusd: Q4's nibbles are
// q (0..15; Q4_0's -8 comes off as 8 * sq), Q8's bytes are flipped to q + 128 (the 128 * sq comes off);
// vpmaddubsw, which saturates 16-bit pairs, takes Q8 as |q| times xq with q's sign instead.
//
// Everything here has internal linkage (cpu_isa.h says why).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/isa_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MINISCHED_GGUF_A8_AVX2 1
#endif

namespace minisched::cpu::a8k {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

constexpr int64_t panel_block_bytes(int qt) { return kPanel * (qt == kQ4_0 ? 18 : (qt == kQ4_1 ? 20 : 34)); }
constexpr int64_t quant_offset(int qt) { return qt == kQ4_1 ? 64 : 32; }
constexpr int groups_per_block(int qt) { return qt == kQ8_0 ? 8 : 4; }
// What vpdpbusd's unsigned operand adds per unit of sq: Q4_0's nibble is q - 8 + 8, Q8's flipped byte q + 128.
constexpr int32_t unsigned_offset(int qt) { return qt == kQ4_0 ? 8 : (qt == kQ8_0 ? 128 : 0); }

inline int32_t load_dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int64_t kMaxRows = 4;  // activation rows per ymm micro-kernel call

constexpr int64_t rows_per_block(int64_t m) {
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  return blocks == 0 ? 1 : (m + blocks - 1) / blocks;
}

// Panels per ymm call: 2 at one or two rows, 1 from three rows on (each panel is two 8-row halves).
constexpr int panels_per_call(int64_t m) { return rows_per_block(m) <= 2 ? 2 : 1; }

#ifdef MINISCHED_GGUF_A8_AVX2
// s = sum over one block of the signed quants times xq, for the 8 rows of half h of a panel-block,
// into 8 int32 lanes.
template <int QT, bool kVnni>
inline __m256i block_dot8(const uint8_t* blk, int h, const int8_t* xq) {
  const uint8_t* qs = blk + quant_offset(QT) + 32 * h;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  if constexpr (kVnni) {
    __m256i s = _mm256_setzero_si256();
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int g = 0; g < groups_per_block(QT); ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g));
      if constexpr (QT == kQ8_0) {
        const __m256i u = _mm256_xor_si256(v, flip), x = _mm256_set1_epi32(load_dword(xq + 4 * g));
        asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(s) : "x"(u), "x"(x));
      } else {
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        const __m256i xl = _mm256_set1_epi32(load_dword(xq + 4 * g));
        const __m256i xh = _mm256_set1_epi32(load_dword(xq + 16 + 4 * g));
        asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(s) : "x"(lo), "x"(xl));
        asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(s) : "x"(hi), "x"(xh));
      }
    }
    return s;
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (QT == kQ8_0) {  // |q| * (xq with q's sign): pairs <= 2 * 128 * 127, no saturation
      __m256i s = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g));
        const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_dword(xq + 4 * g)), v);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), x), ones));
      }
      return s;
    } else {  // nibble pairs <= 2 * 15 * 127; the whole block's 16-bit sums <= 8 * 3810 < 2^15
      __m256i s16 = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_dword(xq + 4 * g))));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_dword(xq + 16 + 4 * g))));
      }
      return _mm256_madd_epi16(s16, ones);
    }
  }
}

// MT activation rows against NP consecutive panels (KB blocks each) over the whole K, one 8-row half
// of the panels at a time.
template <int QT, bool kVnni, int MT, int NP>
inline void micro(const A8Rows& a, const uint8_t* w, int64_t KB, float* out, int64_t ldo, int64_t ncols) {
  constexpr int64_t S = panel_block_bytes(QT);
  constexpr int32_t off = kVnni || QT != kQ8_0 ? unsigned_offset(QT) : 0;  // AVX2's Q8 sums the signed q
  alignas(32) float tmp[MT][NP * kPanel];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MT][NP];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) {
        const uint8_t* blk = w + (p * KB + b) * S;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        __m256 mn = _mm256_setzero_ps();
        if constexpr (QT == kQ4_1)
          mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) {
          const int64_t i = m * KB + b;
          __m256i s = block_dot8<QT, kVnni>(blk, h, a.q + m * a.K + b * kBlock);
          if constexpr (off != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * a.sq[i]));
          acc[m][p] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.dx[i])), _mm256_cvtepi32_ps(s), acc[m][p]);
          if constexpr (QT == kQ4_1)
            acc[m][p] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dx[i] * static_cast<float>(a.sq[i])), acc[m][p]);
        }
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) _mm256_store_ps(tmp[m] + p * kPanel + 8 * h, acc[m][p]);
  }
  for (int m = 0; m < MT; ++m) std::copy(tmp[m], tmp[m] + ncols, out + m * ldo);
}

// Rows [0, M) of a against np_here (<= panels_per_call(M)) consecutive panels at wp (ncols valid
// columns), in balanced blocks of at most kMaxRows rows.
template <int QT, bool kVnni>
inline void panel_rows(const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB, float* out,
                       int64_t ldo, int64_t ncols) {
  const int64_t rows = rows_per_block(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const A8Rows am = a.from_row(m0);
    float* om = out + m0 * ldo;
    if (np_here == 2) {
      if (mt == 1)
        micro<QT, kVnni, 1, 2>(am, wp, KB, om, ldo, ncols);
      else
        micro<QT, kVnni, 2, 2>(am, wp, KB, om, ldo, ncols);
      continue;
    }
    switch (mt) {
      case 1:
        micro<QT, kVnni, 1, 1>(am, wp, KB, om, ldo, ncols);
        break;
      case 2:
        micro<QT, kVnni, 2, 1>(am, wp, KB, om, ldo, ncols);
        break;
      case 3:
        micro<QT, kVnni, 3, 1>(am, wp, KB, om, ldo, ncols);
        break;
      default:
        micro<QT, kVnni, 4, 1>(am, wp, KB, om, ldo, ncols);
    }
  }
}

template <bool kVnni>
inline void panel_rows(int qtype, const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB,
                       float* out, int64_t ldo, int64_t ncols) {
  if (qtype == kQ4_0)
    panel_rows<kQ4_0, kVnni>(a, M, wp, np_here, KB, out, ldo, ncols);
  else if (qtype == kQ4_1)
    panel_rows<kQ4_1, kVnni>(a, M, wp, np_here, KB, out, ldo, ncols);
  else
    panel_rows<kQ8_0, kVnni>(a, M, wp, np_here, KB, out, ldo, ncols);
}
#endif

}  // namespace
}  // namespace minisched::cpu::a8k
