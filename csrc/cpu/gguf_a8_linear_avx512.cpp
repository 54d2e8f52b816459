// The AVX-512 variant of gguf_a8_linear's micro-kernel: a panel-block's 16 rows are the 16 int32 lanes
// of a zmm, so one vpdpbusd multiplies 4 channels of all 16 rows by one broadcast dword of the int8
// activations (64 products; the fp32 kernels do 16 per FMA). The arithmetic, the order of the float
// operations and the layout are gguf_a8_microkernel.h's: the same bits as the ymm variants. Compiled for
// AVX-512 + VNNI after every header (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/avx512_blocks.h"
#include "cpu/gguf_a8_microkernel.h"
#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace minisched::cpu::avx512 {
namespace {

using a8k::kBlock;
using a8k::kPanel;
using a8k::kQ4_0;
using a8k::kQ4_1;
using a8k::kQ8_0;

// acc += the 4-byte dot products of u (unsigned) and x (signed), in place. Inline asm: GCC 12 compiles
// the intrinsic with a register copy of every accumulator (int8_linear_avx512.cpp).
inline void dot4(__m512i& acc, __m512i u, __m512i x) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x)); }

// MT activation rows against NP consecutive panels (KB blocks each) over the whole K.
template <int QT, int MT, int NP>
void micro(const A8Rows& a, const uint8_t* w, int64_t KB, float* out, int64_t ldo, int64_t ncols) {
  constexpr int64_t S = a8k::panel_block_bytes(QT);
  constexpr int32_t off = a8k::unsigned_offset(QT);
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MT][NP];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512i s[MT][NP];
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) s[m][p] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < a8k::groups_per_block(QT); ++g) {
      __m512i xl[MT], xh[MT];
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const int8_t* xq = a.q + m * a.K + b * kBlock;
        xl[m] = _mm512_set1_epi32(a8k::load_dword(xq + 4 * g));
        if constexpr (QT != kQ8_0) xh[m] = _mm512_set1_epi32(a8k::load_dword(xq + 16 + 4 * g));
      }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        const __m512i v = _mm512_loadu_si512(w + (p * KB + b) * S + a8k::quant_offset(QT) + 64 * g);
        if constexpr (QT == kQ8_0) {
          const __m512i u = _mm512_xor_si512(v, flip);
#pragma GCC unroll 4
          for (int m = 0; m < MT; ++m) dot4(s[m][p], u, xl[m]);
        } else {
          const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#pragma GCC unroll 4
          for (int m = 0; m < MT; ++m) {
            dot4(s[m][p], lo, xl[m]);
            dot4(s[m][p], hi, xh[m]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const uint8_t* blk = w + (p * KB + b) * S;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const int64_t i = m * KB + b;
        __m512i si = s[m][p];
        if constexpr (off != 0) si = _mm512_sub_epi32(si, _mm512_set1_epi32(off * a.sq[i]));
        acc[m][p] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.dx[i])), _mm512_cvtepi32_ps(si), acc[m][p]);
      }
      if constexpr (QT == kQ4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) {
          const int64_t i = m * KB + b;
          acc[m][p] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.dx[i] * static_cast<float>(a.sq[i])), acc[m][p]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_mask_storeu_ps(out + m * ldo + p * kPanel, panel_mask(ncols, p), acc[m][p]);
}

template <int QT, int NP>
void rows_block(int64_t mt, const A8Rows& a, const uint8_t* w, int64_t KB, float* out, int64_t ldo, int64_t ncols) {
  switch (mt) {
    case 1:
      return micro<QT, 1, NP>(a, w, KB, out, ldo, ncols);
    case 2:
      return micro<QT, 2, NP>(a, w, KB, out, ldo, ncols);
    case 3:
      if constexpr (NP <= 2) return micro<QT, 3, NP>(a, w, KB, out, ldo, ncols);
      break;
    default:
      if constexpr (NP <= 2) return micro<QT, 4, NP>(a, w, KB, out, ldo, ncols);
  }
  __builtin_trap();  // a8_panels_per_call: 3 and 4 rows take at most 2 panels
}

template <int QT>
void panel_rows(const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB, float* out, int64_t ldo,
                int64_t ncols) {
  const int64_t rows = a8_rows_per_block(M);
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t mt = std::min(rows, M - m0);
    const A8Rows am = a.from_row(m0);
    float* om = out + m0 * ldo;
    switch (np_here) {
      case 4:
        rows_block<QT, 4>(mt, am, wp, KB, om, ldo, ncols);
        break;
      case 3:
        rows_block<QT, 3>(mt, am, wp, KB, om, ldo, ncols);
        break;
      case 2:
        rows_block<QT, 2>(mt, am, wp, KB, om, ldo, ncols);
        break;
      default:
        rows_block<QT, 1>(mt, am, wp, KB, om, ldo, ncols);
    }
  }
}

}  // namespace

void gguf_a8_panel_rows(int qtype, const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB,
                        float* out, int64_t ldo, int64_t ncols) {
  if (qtype == kQ4_0)
    panel_rows<kQ4_0>(a, M, wp, np_here, KB, out, ldo, ncols);
  else if (qtype == kQ4_1)
    panel_rows<kQ4_1>(a, M, wp, np_here, KB, out, ldo, ncols);
  else
    panel_rows<kQ8_0>(a, M, wp, np_here, KB, out, ldo, ncols);
}

}  // namespace minisched::cpu::avx512

#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::gguf_a8_panel_rows(int, const A8Rows&, int64_t, const uint8_t*, int64_t, int64_t, float*,
                                                int64_t, int64_t) {
  __builtin_trap();
}
#endif
