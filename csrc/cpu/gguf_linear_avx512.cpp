// The AVX-512 variant of gguf_linear's micro-kernel below 16 rows (decode): a panel-block's 16 rows
// are one zmm register, so each weight vector is dequantized once for all 16 output columns (the AVX2
// kernel does two 8-row halves), and 32 registers hold up to 16 accumulators beside the block scales.
// The dequantization and the FMA chains are the AVX2 kernel's (gguf_microkernel.h), in the same
// order: the same bits. Compiled for AVX-512 after every header (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/gguf_microkernel.h"
#include "cpu/avx512_blocks.h"
#include "cpu/isa_kernels.h"
#include "cpu/row_blocks.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

namespace minisched::cpu::avx512 {
namespace {

using ggufk::kBlock;
using ggufk::kPanel;
using ggufk::kQ4_0;
using ggufk::kQ4_1;
using ggufk::kQ8_0;

struct Scales16 {
  __m512 d, m;
};

template <int QT>
inline Scales16 load_scales(const uint8_t* blk) {
  Scales16 s;
  s.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  if constexpr (QT == kQ4_1)
    s.m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  else
    s.m = QT == kQ4_0 ? _mm512_mul_ps(s.d, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps();  // -8 d: exact
  return s;
}

// The 16 weights (rows 0..15) of channel c of a panel-block as float32; kHigh: the high nibbles.
template <int QT, bool kHigh>
inline __m512 dequant16(const uint8_t* q16, const Scales16& s) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q16));
  if constexpr (QT == kQ8_0) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s.d);
  } else {
    __m512i v = _mm512_cvtepu8_epi32(bytes);
    v = kHigh ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0xF));
    const __m512 q = _mm512_cvtepi32_ps(v);
    return _mm512_fmadd_ps(s.d, q, s.m);  // one FMA, gguf's bits (gguf_microkernel.h, above Scales)
  }
}

// MT activation rows against NP consecutive panels (KB blocks each) over the whole K.
template <int QT, int MT, int NP>
void micro(const float* x, int64_t ldx, const uint8_t* w, int64_t KB, float* out, int64_t ldo, int64_t ncols) {
  constexpr int64_t S = ggufk::panel_block_bytes(QT);
  constexpr int kPasses = QT == kQ8_0 ? 1 : 2;    // Q4: the low nibbles (channels 0..15), then the high ones
  constexpr int64_t kPerPass = kBlock / kPasses;  // channels per pass
  __m512 acc[MT][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    Scales16 s[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) s[p] = load_scales<QT>(w + (p * KB + b) * S);
    const uint8_t* qs = w + b * S + ggufk::quant_offset(QT);
    const float* xb = x + b * kBlock;
#pragma GCC unroll 2
    for (int pass = 0; pass < kPasses; ++pass) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < kPerPass; ++j) {
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const uint8_t* q16 = qs + p * KB * S + j * kPanel;
          const __m512 wv = pass == 0 ? dequant16<QT, false>(q16, s[p]) : dequant16<QT, true>(q16, s[p]);
#pragma GCC unroll 8
          for (int m = 0; m < MT; ++m)
            acc[m][p] = _mm512_fmadd_ps(_mm512_set1_ps(xb[m * ldx + pass * kPerPass + j]), wv, acc[m][p]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_mask_storeu_ps(out + m * ldo + p * kPanel, panel_mask(ncols, p), acc[m][p]);
}

template <int QT, int NP>
void rows_block(int64_t mt, const float* x, int64_t ldx, const uint8_t* w, int64_t KB, float* out, int64_t ldo,
                int64_t ncols) {
  if constexpr (NP >= 3) {  // gguf_panels_per_call: one or two rows only
    if (mt == 1) return micro<QT, 1, NP>(x, ldx, w, KB, out, ldo, ncols);
    return micro<QT, 2, NP>(x, ldx, w, KB, out, ldo, ncols);
  } else {
    with_rows(mt, [&]<int MT>() { micro<QT, MT, NP>(x, ldx, w, KB, out, ldo, ncols); });
  }
}

template <int QT>
void panel_rows(const float* x, int64_t M, int64_t ldx, const uint8_t* wp, int64_t np_here, int64_t KB, float* out,
                int64_t ldo, int64_t ncols) {
  const int64_t rows = gguf_rows_per_block(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const float* xm = x + m0 * ldx;
    float* om = out + m0 * ldo;
    switch (np_here) {
      case 4:
        rows_block<QT, 4>(mt, xm, ldx, wp, KB, om, ldo, ncols);
        break;
      case 3:
        rows_block<QT, 3>(mt, xm, ldx, wp, KB, om, ldo, ncols);
        break;
      case 2:
        rows_block<QT, 2>(mt, xm, ldx, wp, KB, om, ldo, ncols);
        break;
      default:
        rows_block<QT, 1>(mt, xm, ldx, wp, KB, om, ldo, ncols);
    }
  }
}

}  // namespace

void gguf_panel_rows(int qtype, const float* x, int64_t M, int64_t ldx, const uint8_t* wp, int64_t np_here, int64_t KB,
                     float* out, int64_t ldo, int64_t ncols) {
  switch (qtype) {
    case kQ4_0:
      return panel_rows<kQ4_0>(x, M, ldx, wp, np_here, KB, out, ldo, ncols);
    case kQ4_1:
      return panel_rows<kQ4_1>(x, M, ldx, wp, np_here, KB, out, ldo, ncols);
    default:
      return panel_rows<kQ8_0>(x, M, ldx, wp, np_here, KB, out, ldo, ncols);
  }
}

}  // namespace minisched::cpu::avx512

#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::gguf_panel_rows(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                             float*, int64_t, int64_t) {
  __builtin_trap();
}
#endif
