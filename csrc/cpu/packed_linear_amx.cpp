// The AMX variant of packed_linear's bfloat16 panels (`--quantize bf16`), for 16 rows and more
// (prefill, large batches): tile dot products of bf16 pairs summed in float32 (tdpbf16ps).
//
// The activations stay float32 in meaning: each x splits exactly into three bf16 terms, x = hi + mid
// + lo (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid, which has at most 8 significant bits),
// and a bf16 x bf16 product is exact in float32, so the tiles sum the same products as the AVX-512
// kernel -- x times the bf16-rounded weight -- in another order (three terms per product, 32
// channels per tile step). The result is the float32 kernel's on the rounded weight up to float32
// summation order, not its bits: a row's output from 16 rows on may differ in the last bits from the
// same row computed alone (the AVX-512 path). Three tile products per weight tile still run ~4x
// the AVX-512 FMA rate (benchmarks/RESULTS.md).
//
// Tiles: 0 the hi activations of 16 rows x 32 channels, 1 the mid and then the lo ones; 2, 3 two
// panels' weights (relaid out once per call, amx_tiles.h); 4, 5 the two panels' sums of the hi terms,
// 6, 7 of the mid and lo terms (four accumulators: a tile product waits for the one before it on the
// same accumulator), added at the end. Compiled for AVX-512 +
// AMX after every header (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-int8,amx-bf16")

#include "cpu/amx_tiles.h"

namespace minisched::cpu::amx {
namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kKTile = 32;  // bf16 channels per tile row

// _tile_zero takes the tile's number as an immediate.
inline void zero_tile(int t) {
  switch (t) {
    case 4:
      _tile_zero(4);
      break;
    case 5:
      _tile_zero(5);
      break;
    case 6:
      _tile_zero(6);
      break;
    default:
      _tile_zero(7);
  }
}

inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline __m512 from_bf16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

}  // namespace

void bf16_split_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t m0, int64_t m1, uint16_t* hi,
                     uint16_t* mid, uint16_t* lo) {
  for (int64_t m = m0; m < m1; ++m) {
    if (m >= M) {  // padding rows of the last row tile
      for (int64_t k = 0; k < K; k += kKTile) {
        const int64_t o = a_tile_offset(m, k, K, kKTile);
        std::memset(hi + o, 0, kTileBytes);
        std::memset(mid + o, 0, kTileBytes);
        std::memset(lo + o, 0, kTileBytes);
      }
      continue;
    }
    const float* xr = x + m * ldx;
    for (int64_t k = 0; k < K; k += 16) {  // K % 32 == 0
      const __m512 v = _mm512_loadu_ps(xr + k);
      const __m256i b0 = to_bf16(v);
      const __m512 r = _mm512_sub_ps(v, from_bf16(b0));  // exact: v's bits below hi's
      const __m256i b1 = to_bf16(r);
      const __m256i b2 = to_bf16(_mm512_sub_ps(r, from_bf16(b1)));  // exact, and exactly a bf16
      const int64_t o = a_tile_offset(m, k, K, kKTile);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + o), b0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid + o), b1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + o), b2);
    }
  }
}

void bf16_panels(const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, int64_t M, const uint16_t* w,
                 int64_t np_here, int64_t K, float* out, int64_t ldo, int64_t ncols, uint16_t* wbuf) {
  const int64_t wpanel = K * kPanel;
  const bool two = np_here == 2;
  // A panel's channels (16 bf16 each) to pairs of channels (64 bytes: a B-tile row): K / 2 rows.
  for (int64_t p = 0; p < np_here; ++p) interleave_units(w + p * wpanel, wbuf + p * wpanel, K / 2);
  configure_tiles();
  memory_barrier();
  alignas(64) float sums[4][kTileRows][kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    for (int t = 4; t < 8; ++t) zero_tile(t);
    const uint16_t* h = hi + m0 * K;
    const uint16_t* d = mid + m0 * K;
    const uint16_t* l = lo + m0 * K;
    for (int64_t k = 0; k < K; k += kKTile) {
      // Four accumulators, so consecutive tile products do not wait on each other: the hi terms
      // (tiles 4, 5 for panels 0, 1) and the mid + lo terms (6, 7); tile 1 holds mid, then lo.
      _tile_loadd(0, h + 16 * k, kTileBytes);  // the A-tile layout (amx_tiles.h)
      _tile_loadd(1, d + 16 * k, kTileBytes);
      _tile_loadd(2, wbuf + k * kPanel, kTileBytes);  // channel pair k / 2 of panel 0 at byte 64 * (k / 2)
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(6, 1, 2);
      if (two) {
        _tile_loadd(3, wbuf + wpanel + k * kPanel, kTileBytes);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(7, 1, 3);
      }
      _tile_loadd(1, l + 16 * k, kTileBytes);
      _tile_dpbf16ps(6, 1, 2);
      if (two) _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, sums[0], kTileBytes);
    _tile_stored(6, sums[2], kTileBytes);
    if (two) {
      _tile_stored(5, sums[1], kTileBytes);
      _tile_stored(7, sums[3], kTileBytes);
    }
    memory_barrier();
    const int64_t rows = std::min(kTileRows, M - m0);
    for (int64_t r = 0; r < rows; ++r)
      for (int p = 0; p < np_here; ++p) {
        const int64_t c = std::clamp<int64_t>(ncols - p * kPanel, 0, kPanel);
        const __m512 v = _mm512_add_ps(_mm512_load_ps(sums[2 + p][r]), _mm512_load_ps(sums[p][r]));
        _mm512_mask_storeu_ps(out + (m0 + r) * ldo + p * kPanel, static_cast<__mmask16>((1u << c) - 1u), v);
      }
  }
  _tile_release();
}

}  // namespace minisched::cpu::amx

#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::amx::bf16_split_rows(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*,
                                          uint16_t*, uint16_t*) {
  __builtin_trap();
}
void minisched::cpu::amx::bf16_panels(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, const uint16_t*,
                                      int64_t, int64_t, float*, int64_t, int64_t, uint16_t*) {
  __builtin_trap();
}
#endif
