// The AMX variant of int8_linear, for 32 rows and more (prefill, large batches): the same exact
// integer sums as the vpdpwssd kernels, from int8 tile dot products, so the outputs are the same bits.
//
// AMX multiplies int8 by int8, and int8_linear's activations are int16. Each int16 q splits exactly
// into q = 256 hi + lo with hi = q >> 8 (signed byte) and lo = q & 255 (unsigned byte), so
//   sum_k q_k w_k = 256 sum_k hi_k w_k + sum_k lo_k w_k,
// two tile dot products (tdpbssd for hi, tdpbusd for lo) per weight tile. Over one int32 block of
// 256 channels |sum hi w| <= 256 x 128 x 127 and |sum lo w| <= 256 x 255 x 127, so both sums and the
// combination are exact in int32 and equal the vpdpwssd kernels' sum (int8_microkernel.h). The float
// steps after it -- convert, FMA with the group's scale in k order, times the row's scale -- are those
// kernels', in the same order: the same bits, so a row's result still does not depend on its batch.
//
// Tiles: 0, 1 the hi and lo activations of 16 rows x 64 channels; 2, 3 two panels' weights
// (relayed out once per call, amx_tiles.h); 4..7 the int32 sums (hi, lo) x (panel 0, 1). Compiled for
// AVX-512 + AMX after every header (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/avx512_blocks.h"
#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8,amx-bf16")

#include "cpu/amx_tiles.h"

namespace minisched::cpu::amx {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kInt32Block = 256;  // as int8_microkernel.h: the same blocks, the same float steps
constexpr int64_t kKTile = 64;        // int8 channels per tile row

}  // namespace

void int8_split_rows(const int16_t* q, int64_t M, int64_t K, int64_t m0, int64_t m1, int8_t* hi, uint8_t* lo) {
  const __m512i low_byte = _mm512_set1_epi16(0xFF);
  for (int64_t m = m0; m < m1; ++m) {
    if (m >= M) {  // padding rows of the last row tile
      for (int64_t k = 0; k < K; k += kKTile) {
        const int64_t o = a_tile_offset(m, k, K, kKTile);
        std::memset(hi + o, 0, kTileBytes);
        std::memset(lo + o, 0, kTileBytes);
      }
      continue;
    }
    const int16_t* qr = q + m * K;
    for (int64_t k = 0; k < K; k += 32) {  // K % 64 == 0 (int8_amx_ok)
      const __m512i v = _mm512_loadu_si512(qr + k);
      const int64_t o = a_tile_offset(m, k, K, kKTile);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + o), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + o), _mm512_cvtepi16_epi8(_mm512_and_si512(v, low_byte)));
    }
  }
}

void int8_panels(const int8_t* hi, const uint8_t* lo, int64_t M, const float* sx, const int8_t* w, const float* ws,
                 int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols, int8_t* wbuf) {
  const int64_t ng = K / G, wpanel = K * kPanel, spanel = ng * kPanel;
  const bool two = np_here == 2;
  // A panel's pairs of channels (32 bytes each) to quads (64 bytes: a B-tile row): K / 4 rows.
  for (int64_t p = 0; p < np_here; ++p) interleave_units(w + p * wpanel, wbuf + p * wpanel, K / 4);
  configure_tiles();
  memory_barrier();
  alignas(64) int32_t sums[4][kTileRows][kPanel];
  alignas(64) float facc[kTileRows][2][kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    std::memset(facc, 0, sizeof(facc));
    const int8_t* h = hi + m0 * K;
    const uint8_t* l = lo + m0 * K;
    for (int64_t g = 0; g < ng; ++g) {
      for (int64_t c0 = g * G; c0 < (g + 1) * G; c0 += kInt32Block) {
        const int64_t c1 = std::min((g + 1) * G, c0 + kInt32Block);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k = c0; k < c1; k += kKTile) {
          _tile_loadd(0, h + 16 * k, kTileBytes);  // the A-tile layout (amx_tiles.h)
          _tile_loadd(1, l + 16 * k, kTileBytes);
          _tile_loadd(2, wbuf + k * kPanel, kTileBytes);  // quad k / 4 of panel 0 at byte 64 * (k / 4)
          _tile_dpbssd(4, 0, 2);
          _tile_dpbusd(5, 1, 2);
          if (two) {
            _tile_loadd(3, wbuf + wpanel + k * kPanel, kTileBytes);
            _tile_dpbssd(6, 0, 3);
            _tile_dpbusd(7, 1, 3);
          }
        }
        _tile_stored(4, sums[0], kTileBytes);
        _tile_stored(5, sums[1], kTileBytes);
        if (two) {
          _tile_stored(6, sums[2], kTileBytes);
          _tile_stored(7, sums[3], kTileBytes);
        }
        memory_barrier();
        for (int64_t p = 0; p < np_here; ++p) {
          const __m512 s = _mm512_loadu_ps(ws + p * spanel + g * kPanel);
          for (int64_t r = 0; r < kTileRows; ++r) {
            const __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[2 * p][r]), 8),
                                                   _mm512_load_si512(sums[2 * p + 1][r]));
            _mm512_store_ps(facc[r][p], _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), s, _mm512_load_ps(facc[r][p])));
          }
        }
      }
    }
    const int64_t rows = std::min(kTileRows, M - m0);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 scale = _mm512_set1_ps(sx[m0 + r]);
      for (int p = 0; p < np_here; ++p)
        _mm512_mask_storeu_ps(out + (m0 + r) * ldo + p * kPanel, avx512::panel_mask(ncols, p),
                              _mm512_mul_ps(_mm512_load_ps(facc[r][p]), scale));
    }
  }
  _tile_release();
}

}  // namespace minisched::cpu::amx

#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::amx::int8_split_rows(const int16_t*, int64_t, int64_t, int64_t, int64_t, int8_t*, uint8_t*) {
  __builtin_trap();
}
void minisched::cpu::amx::int8_panels(const int8_t*, const uint8_t*, int64_t, const float*, const int8_t*, const float*,
                                      int64_t, int64_t, int64_t, float*, int64_t, int64_t, int8_t*) {
  __builtin_trap();
}
#endif
