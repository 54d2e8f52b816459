// The block formats of gguf_linear (gguf_linear.cpp) and their dequantization: the panel layout,
// the scalar dequantizer (the generic build's and the reference's arithmetic) and, with AVX2, the
// register-blocked micro-kernel for few activation rows.
//
// Formats (GGML's block of 32 input channels; value w[c] of channel c in the block):
//   Q4_0 (type 2)  fp16 d, 16 bytes qs:        w[c] = d * (q[c] - 8)
//   Q4_1 (type 3)  fp16 d, fp16 m, 16 bytes:    w[c] = d * q[c] + m
//   Q8_0 (type 8)  fp16 d, 32 int8 qs:          w[c] = q[c] * d
// with the 4-bit q[c] = low nibble of qs[c] for c < 16, high nibble of qs[c - 16] otherwise. Each
// value is computed in float32 as gguf.quants.dequantize computes it (d * q rounded, then + m
// rounded): the dequantized weight is bit for bit the float32 model's.
//
// Layout (ops.pack_gguf_weight): panels of 16 output rows, as packed_linear's; per panel and block
// one panel-block of 16 x the format's block bytes (so the bytes per weight are the file's):
//   [0, 32)    d of rows 0..15 (fp16)
//   [32, 64)   m of rows 0..15 (fp16; Q4_1 only)
//   then       Q4: 16 x 16 bytes, [j][r] = row r's qs[j] (low nibble: channel j, high: channel j + 16)
//              Q8: 32 x 16 int8,  [c][r] = row r's q[c]
// so one 16-byte load holds one channel (or channel pair) of all 16 rows, the lanes of the FMAs.
//
// Every output is one FMA chain over k in order, started from zero, on those dequantized weights:
// the same operations as packed_linear on the dequantized float32 weight, so the results are its
// bits, whatever the rows around a row or the thread split.
//
// Everything here has internal linkage (cpu_isa.h says why).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/row_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MINISCHED_GGUF_AVX2 1
#endif

namespace minisched::cpu::ggufk {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;                  // input channels per block
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML's type ids (gguf.GGMLQuantizationType)

constexpr int64_t block_bytes(int qt) { return qt == kQ4_0 ? 18 : (qt == kQ4_1 ? 20 : 34); }
constexpr int64_t panel_block_bytes(int qt) { return kPanel * block_bytes(qt); }
constexpr int64_t quant_offset(int qt) { return qt == kQ4_1 ? 64 : 32; }

// fp16 bits to float32 (exact), without F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_float(h);
}

// Dequantize panel-block `blk` (format QT) to float32, k-major as packed_linear's panels:
// dst[c * 16 + r] = w[row r, channel c]. The float products and sums are done in double and rounded
// once to float32: the correctly rounded float32 result (53 >= 2 * 24 + 2), so no FMA contraction can
// change them.
template <int QT>
inline void dequant_block_generic(const uint8_t* blk, float* dst) {
  const uint8_t* qs = blk + quant_offset(QT);
  for (int64_t r = 0; r < kPanel; ++r) {
    const double d = load_half(blk + 2 * r);
    const float m = QT == kQ4_1 ? load_half(blk + 32 + 2 * r) : 0.f;
    for (int64_t c = 0; c < kBlock; ++c) {
      float w;
      if constexpr (QT == kQ8_0) {
        w = static_cast<float>(static_cast<double>(static_cast<int8_t>(qs[c * kPanel + r])) * d);
      } else {
        const uint8_t byte = qs[(c % 16) * kPanel + r];
        const int q = c < 16 ? (byte & 0xF) : (byte >> 4);
        if constexpr (QT == kQ4_0) {
          w = static_cast<float>(d * (q - 8));
        } else {
          const float dq = static_cast<float>(d * q);
          w = static_cast<float>(static_cast<double>(dq) + static_cast<double>(m));
        }
      }
      dst[c * kPanel + r] = w;
    }
  }
}

// One FMA per Q4 weight: the vector kernels dequantize a Q4 weight with one FMA, d * q + m' (Q4_1: m' = m; Q4_0:
// m' = -8 d), and get gguf's bits. d is a half (11 significant bits) and q < 16 (4 bits), so d * q is
// exact in float32 (15 bits): Q4_1's fl(fl(d * q) + m) is fl(d * q + m), one rounding, which the FMA does;
// Q4_0's d * q - 8 d is d * (q - 8) exactly, a float32 value (15 bits), which the FMA returns unrounded.
// (One instruction instead of two: ~15 % of the decode kernel's per-weight work.)

#ifdef MINISCHED_GGUF_AVX2
// The block scales of one panel-block's 8-row half h (Q4_0: m holds -8 d).
struct Scales {
  __m256 d, m;
};

template <int QT>
inline Scales load_scales(const uint8_t* blk, int h) {
  Scales s;
  s.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
  if constexpr (QT == kQ4_1)
    s.m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
  else
    s.m = QT == kQ4_0 ? _mm256_mul_ps(s.d, _mm256_set1_ps(-8.f)) : _mm256_setzero_ps();  // -8 d: exact
  return s;
}

// The 8 weights (rows 8h .. 8h + 7) of channel c of a panel-block, as float32. kHigh: the high nibbles
// (channels 16..31 of a Q4 block; `q8` then points at channel c - 16's bytes).
template <int QT, bool kHigh>
inline __m256 dequant8(const uint8_t* q8, const Scales& s) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q8));
  if constexpr (QT == kQ8_0) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s.d);
  } else {
    __m256i v = _mm256_cvtepu8_epi32(bytes);
    v = kHigh ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0xF));
    const __m256 q = _mm256_cvtepi32_ps(v);
    return _mm256_fmadd_ps(s.d, q, s.m);  // one FMA, gguf's bits (the note above Scales)
  }
}

template <int QT>
inline void dequant_block(const uint8_t* blk, float* dst) {
  const uint8_t* qs = blk + quant_offset(QT);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const Scales s = load_scales<QT>(blk, h);
    if constexpr (QT == kQ8_0) {
      for (int64_t c = 0; c < kBlock; ++c)
        _mm256_storeu_ps(dst + c * kPanel + 8 * h, dequant8<QT, false>(qs + c * kPanel + 8 * h, s));
    } else {
      for (int64_t j = 0; j < 16; ++j) {
        _mm256_storeu_ps(dst + j * kPanel + 8 * h, dequant8<QT, false>(qs + j * kPanel + 8 * h, s));
        _mm256_storeu_ps(dst + (j + 16) * kPanel + 8 * h, dequant8<QT, true>(qs + j * kPanel + 8 * h, s));
      }
    }
  }
}
#else
template <int QT>
inline void dequant_block(const uint8_t* blk, float* dst) {
  dequant_block_generic<QT>(blk, dst);
}
#endif

// np_here consecutive panels (KB blocks each, at wp) to float32 in packed_linear's layout:
// dst[(p * K + k) * 16 + r].
template <int QT>
inline void dequant_panels(const uint8_t* wp, int64_t np_here, int64_t KB, float* dst) {
  for (int64_t p = 0; p < np_here; ++p)
    for (int64_t b = 0; b < KB; ++b)
      dequant_block<QT>(wp + (p * KB + b) * panel_block_bytes(QT), dst + (p * KB + b) * kBlock * kPanel);
}

#ifdef MINISCHED_GGUF_AVX2
constexpr int64_t kMaxRows = 8;  // activation rows per micro-kernel call (8 accumulators at one panel)

constexpr int64_t rows_per_block(int64_t m) {
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  return blocks == 0 ? 1 : (m + blocks - 1) / blocks;
}

// Panels per call: enough FMA chains (MT x NP) to cover the FMA latency behind the dequantization: 4
// panels at one row, 2 at two, 1 from three rows on (the weights dequantized once feed MT rows).
constexpr int panels_per_call(int64_t m) {
  const int64_t rows = rows_per_block(m);
  return rows == 1 ? 4 : (rows == 2 ? 2 : 1);
}

// MT activation rows against NP consecutive panels (KB blocks each) over the whole K, one 8-row half
// of the panels at a time (MT x NP accumulators: with the block scales and the broadcast activations
// they fit the 16 ymm registers; both halves at once would spill the accumulators). Every loop over m
// and p is fully unrolled, in this one function: the accumulators must stay in registers.
template <int QT, int MT, int NP>
inline void micro(const float* x, int64_t ldx, const uint8_t* w, int64_t KB, float* out, int64_t ldo, int64_t ncols) {
  constexpr int64_t S = panel_block_bytes(QT);
  constexpr int kPasses = QT == kQ8_0 ? 1 : 2;    // Q4: the low nibbles (channels 0..15), then the high ones
  constexpr int64_t kPerPass = kBlock / kPasses;  // channels per pass
  alignas(32) float tmp[MT][NP * kPanel];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MT][NP];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      Scales s[NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) s[p] = load_scales<QT>(w + (p * KB + b) * S, h);
      const uint8_t* qs = w + b * S + quant_offset(QT) + 8 * h;
      const float* xb = x + b * kBlock;
#pragma GCC unroll 2
      for (int pass = 0; pass < kPasses; ++pass) {
#pragma GCC unroll 4
        for (int64_t j = 0; j < kPerPass; ++j) {
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            const uint8_t* q8 = qs + p * KB * S + j * kPanel;
            const __m256 wv = pass == 0 ? dequant8<QT, false>(q8, s[p]) : dequant8<QT, true>(q8, s[p]);
            // (broadcast at its use: with one panel only one is live; with more, GCC shares them)
#pragma GCC unroll 8
            for (int m = 0; m < MT; ++m)
              acc[m][p] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + m * ldx + pass * kPerPass + j), wv, acc[m][p]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) _mm256_store_ps(tmp[m] + p * kPanel + 8 * h, acc[m][p]);
  }
  for (int m = 0; m < MT; ++m) std::copy(tmp[m], tmp[m] + ncols, out + m * ldo);
}

template <int QT, int NP>
inline void rows_block(int64_t mt, const float* x, int64_t ldx, const uint8_t* w, int64_t KB, float* out, int64_t ldo,
                       int64_t ncols) {
  with_rows(mt, [&]<int MT>() { micro<QT, MT, NP>(x, ldx, w, KB, out, ldo, ncols); });
}

// Rows [0, M) of x against np_here (<= panels_per_call(M)) consecutive panels at wp (ncols valid
// columns), in balanced blocks of at most kMaxRows rows.
template <int QT>
inline void panel_rows(const float* x, int64_t M, int64_t ldx, const uint8_t* wp, int64_t np_here, int64_t KB,
                       float* out, int64_t ldo, int64_t ncols) {
  const int64_t rows = rows_per_block(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const float* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
    switch (np_here) {
      case 4:
        if (mt == 1) micro<QT, 1, 4>(xm, ldx, wp, KB, om, ldo, ncols);
        break;
      case 3:
        if (mt == 1) micro<QT, 1, 3>(xm, ldx, wp, KB, om, ldo, ncols);
        break;
      case 2:
        if (mt == 1)
          micro<QT, 1, 2>(xm, ldx, wp, KB, om, ldo, ncols);
        else
          micro<QT, 2, 2>(xm, ldx, wp, KB, om, ldo, ncols);
        break;
      default:
        rows_block<QT, 1>(mt, xm, ldx, wp, KB, om, ldo, ncols);
    }
  }
}
#endif

}  // namespace
}  // namespace minisched::cpu::ggufk
