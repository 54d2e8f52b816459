// What the AMX variants (int8_linear_amx.cpp, packed_linear_amx.cpp) share: the tile configuration
// and the relayout of a 16-column panel into the operand order of the tile dot products.
//
// AMX multiplies tiles: an A tile of 16 rows x 64 bytes (activations), a B tile of 16 rows x 64
// bytes whose row r holds, for each of 16 output columns, the 4 bytes of input channels 4r..4r+3
// (int8) or 2r..2r+1 (bf16) side by side, and a C tile of 16 x 16 int32 / float32 accumulators.
// minisched's panels hold, for each step of 2 bytes-per-column (int8: a pair of channels; bf16: one
// channel), 16 columns x 2 bytes: two such consecutive 32-byte rows interleaved by 16-bit units are
// one B-tile row. One vpermw per 64 bytes, done once per panel and call, reused by every row tile.
//
// Everything here has internal linkage and is included inside each file's target pragma (cpu_isa.h
// says why). Linux grants the tile data per process (cpu_isa.cpp asks at load); each thread
// configures its tiles before use and releases them after, so a context switch saves no tile state
// outside a kernel.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace minisched::cpu::amx {
namespace {

constexpr int64_t kTileRows = 16;   // rows of every tile
constexpr int64_t kTileBytes = 64;  // bytes per tile row

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..7 as 16 rows x 64 bytes (the only shape the kernels use: partial rows are zero padding).
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = kTileBytes;
    c.rows[t] = kTileRows;
  }
  asm volatile("" ::: "memory");  // _tile_loadconfig's asm names only the first bytes as its input
  _tile_loadconfig(&c);
}

// The intrinsics' asm reads and writes memory the compiler does not see: order buffer writes before
// tile loads, and tile stores before the reads of what they stored.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// The activations are stored tile by tile (A-tile layout): for each 16-row tile and each 64-byte
// step of channels, its 16 rows x 64 bytes contiguous, so a tile load reads 1 KB in order (a strided
// load of 16 rows of a row-major matrix from L2 cost ~5x the tile product). The element of row m,
// byte-column c (of kcols = 64 / element size per step) in a matrix of K channels:
inline int64_t a_tile_offset(int64_t m, int64_t k, int64_t K, int64_t kcols) {
  return ((m / kTileRows) * (K / kcols) + k / kcols) * kTileRows * kcols + (m % kTileRows) * kcols + k % kcols;
}
// so row tile t (rows 16 t ..) starts at element 16 t K, and its channel step k at 16 k past that.

// rows64 rows of 64 bytes from src (each two 32-byte rows a, b of 16 16-bit units) to dst, the units
// interleaved: dst unit 2j = a_j, 2j + 1 = b_j (column j's 4 bytes side by side).
inline void interleave_units(const void* src, void* dst, int64_t rows64) {
  alignas(64) static constexpr int16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (int64_t r = 0; r < rows64; ++r)
    _mm512_storeu_si512(d + r * kTileBytes, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(s + r * kTileBytes)));
}

}  // namespace
}  // namespace minisched::cpu::amx
