// Entry points of the CPU kernels' ISA variants (csrc/cpu/*_avx512.cpp, *_avx2vnni.cpp): plain
// functions on raw pointers, framework-free. Declared plainly: each is compiled for its ISA by the
// `#pragma GCC target` region of its file (cpu_isa.h says why not an attribute). The ATen glue
// (<op>.cpp) picks one by cpu::isa().
#pragma once

#include <cstdint>

#include "cpu/cpu_isa.h"

namespace minisched::cpu {

// gguf_a8_linear's activations (gguf_a8_microkernel.h): rows of x rounded to int8 per block of 32
// channels, q [M, K], with the blocks' scales dx [M, K / 32] and sums of q, sq [M, K / 32].
struct A8Rows {
  const int8_t* q;
  const float* dx;
  const int32_t* sq;
  int64_t K;
  A8Rows from_row(int64_t m) const { return {q + m * K, dx + m * (K / 32), sq + m * (K / 32), K}; }
};

namespace avx512 {

// -- packed_linear (packed_linear_avx512.cpp) --
constexpr int64_t kPackedMaxRows = 8;  // activation rows per micro-kernel call

// Rows per block for M rows: balanced blocks of at most kPackedMaxRows (9 rows: 5 + 4, not 8 + 1).
constexpr int64_t packed_rows_per_block512(int64_t m) {
  const int64_t blocks = (m + kPackedMaxRows - 1) / kPackedMaxRows;
  return blocks == 0 ? 1 : (m + blocks - 1) / blocks;
}

// Panels per micro-kernel call for M rows: 8 FMA chains at one row, at most 24 accumulators of the
// 32 zmm registers otherwise (rows x panels: 1 x 8, 2..6 x 4, 7..8 x 3).
constexpr int packed_panels_per_call(int64_t m) {
  const int64_t rows = packed_rows_per_block512(m);
  return rows == 1 ? 8 : (rows <= 6 ? 4 : 3);
}

// Rows [0, M) of x against `np_here` (<= packed_panels_per_call(M)) consecutive panels at wp,
// whose first `ncols` columns are written to out (row stride ldo). The weights are float32 or
// bfloat16 (uint16_t bits, widened as they are loaded: the float32 kernel's bits on the rounded weight).
void packed_panel_rows(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t np_here, int64_t K, float* out,
                       int64_t ldo, int64_t ncols);
void packed_panel_rows(const float* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t np_here, int64_t K,
                       float* out, int64_t ldo, int64_t ncols);

// -- gguf_linear below 16 rows (gguf_linear_avx512.cpp; formats and layout in gguf_microkernel.h) --
constexpr int64_t kGgufMaxRows = 8;  // activation rows per micro-kernel call

constexpr int64_t gguf_rows_per_block(int64_t m) {
  const int64_t blocks = (m + kGgufMaxRows - 1) / kGgufMaxRows;
  return blocks == 0 ? 1 : (m + blocks - 1) / blocks;
}

// Panels per call: 4 at one or two rows (4 or 8 FMA chains beside 8 block-scale registers), 2 from
// three rows on (up to 16 accumulators).
constexpr int gguf_panels_per_call(int64_t m) { return gguf_rows_per_block(m) <= 2 ? 4 : 2; }

// Rows [0, M) of x against np_here (<= gguf_panels_per_call(M)) consecutive panels of format qtype
// (2, 3, 8) at wp, KB blocks each; the first ncols columns go to out (row stride ldo).
void gguf_panel_rows(int qtype, const float* x, int64_t M, int64_t ldx, const uint8_t* wp, int64_t np_here, int64_t KB,
                     float* out, int64_t ldo, int64_t ncols);

// -- gguf_a8_linear (gguf_a8_linear_avx512.cpp; arithmetic and layout in gguf_a8_microkernel.h) --
constexpr int64_t kA8MaxRows = 4;  // activation rows per micro-kernel call

constexpr int64_t a8_rows_per_block(int64_t m) {
  const int64_t blocks = (m + kA8MaxRows - 1) / kA8MaxRows;
  return blocks == 0 ? 1 : (m + blocks - 1) / blocks;
}

// Panels per call: 4 at one or two rows (up to 8 int32 sums and 8 float accumulators), 2 from three on.
constexpr int a8_panels_per_call(int64_t m) { return a8_rows_per_block(m) <= 2 ? 4 : 2; }

// Rows [0, M) of a against np_here (<= a8_panels_per_call(M)) consecutive panels of format qtype at wp,
// KB blocks each; the first ncols columns go to out (row stride ldo).
void gguf_a8_panel_rows(int qtype, const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB,
                        float* out, int64_t ldo, int64_t ncols);

// -- rms_norm (rms_norm_avx512.cpp) --
// Rows [m0, m1) of x [M, D]: x += delta (when not null), then out = x / rms(x) * w.
void rms_norm_rows(float* x, const float* delta, const float* w, float eps, float* out, int64_t D, int64_t m0,
                   int64_t m1);

// -- silu_and_mul (silu_and_mul_avx512.cpp) --
// Rows [m0, m1) of x [M, 2D] (gate, then up): out [M, D] = silu(gate) * up.
void silu_and_mul_rows(const float* x, float* out, int64_t D, int64_t m0, int64_t m1);

// -- int8_linear (int8_linear_avx512.cpp; layout and arithmetic in int8_microkernel.h) --
// Rows [0, M) of the int16 activations q (row stride ldq, row scales sx) against np_here (<=
// packed_panels_per_call(M)) consecutive panels of w_packed at w (K * 16 bytes each) with their group
// scales at ws (K / G * 16 floats each); the first ncols columns go to out (row stride ldo).
void int8_panel_rows(const int16_t* q, int64_t M, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                     int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols);

// -- the attention loop's block products (attention_avx512.cpp; the loop is attention_cpu.h) --
// S[r * lds + j] = <q_r, k_j> for `rows` query rows q [rows, d] and n keys (row pointers); d % 16 == 0.
void attn_block_scores(const float* q, int64_t rows, int64_t d, const float* const* k, int64_t n, float* S,
                       int64_t lds);
// acc_r += sum_j P[r * ldp + j] v_j for `rows` accumulator rows [rows, d] and n values; d % 16 == 0.
void attn_block_accumulate(float* acc, int64_t rows, int64_t d, const float* P, int64_t ldp, const float* const* v,
                           int64_t n);
// One online-softmax step of a lane group: up to 16 query rows (`rows` valid) against n (<= kBlock) keys
// at j0.. of a block, the rows in the lanes of one zmm. qt [d][16]: the rows' pre-scaled q, transposed
// (zeros past `rows`); lim [16]: each row's last visible KV position; m, l [16]: the running max and sum;
// acc [16][d]: the running output rows; pt [kBlock][16]: scratch for the block's probabilities.
// Scores come out key-major (one FMA per key per input channel, no horizontal sums), so the softmax's
// max, exp and sum run across the 16 rows at once. d % 16 == 0.
void attn_block_lanes(const float* qt, int64_t d, const float* const* k, const float* const* v, int64_t n, int64_t j0,
                      const int32_t* lim, int64_t rows, float* m, float* l, float* acc, float* pt);

}  // namespace avx512

namespace avx2vnni {

// int8_linear's ymm micro-kernel with AVX-VNNI (int8_linear_avx2vnni.cpp); panels per call as
// int8k::panels_per_call (int8_microkernel.h).
void int8_panel_rows(const int16_t* q, int64_t M, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                     int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols);

// gguf_a8_linear's ymm micro-kernel with AVX-VNNI (gguf_a8_linear_avx2vnni.cpp); panels per call as
// a8k::panels_per_call (gguf_a8_microkernel.h).
void gguf_a8_panel_rows(int qtype, const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB,
                        float* out, int64_t ldo, int64_t ncols);

}  // namespace avx2vnni

namespace amx {

// The AMX variants take 16 rows and more (a whole tile of activation rows); fewer rows run the
// AVX-512 kernels, which give the same bits (int8_linear).
constexpr int64_t kMinRows = 16;
// int8_linear takes its AMX path from 32 rows: at 16 it measured level with the AVX-512 kernel on one
// thread and 0.88-0.90x on two (benchmarks/kernels/bench_amx.py, 2026-12-06), and the bits are the same.
constexpr int64_t kInt8MinRows = 32;
constexpr int64_t kPanelsPerTask = 2;  // 32 output columns: two weight tiles per row tile
// Rows per call of the kernels below (a multiple of 16): a block's split activations (64 rows x K x
// 2 or 3 terms) stay in L2 while a task's panels pass; the panels are relaid out once per block.
constexpr int64_t kRowBlock = 64;

// -- int8_linear (int8_linear_amx.cpp) --
// Rows [m0, m1) of the int16 activations q [M, K] (K % 64 == 0) split into hi (q >> 8, int8) and lo
// (q & 255, uint8), in the A-tile layout (amx_tiles.h: rows [16 t, 16 t + 16) from element 16 t K);
// rows >= M (up to a multiple of 16) are zero.
void int8_split_rows(const int16_t* q, int64_t M, int64_t K, int64_t m0, int64_t m1, int8_t* hi, uint8_t* lo);
// Rows [0, M) of hi / lo (padded to a multiple of 16 rows) against np_here (<= kPanelsPerTask)
// consecutive panels of w_packed at w with their group scales at ws (G % 64 == 0), as
// avx512::int8_panel_rows; wbuf: np_here * K * 16 bytes for the relaid-out panels.
void int8_panels(const int8_t* hi, const uint8_t* lo, int64_t M, const float* sx, const int8_t* w, const float* ws,
                 int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols, int8_t* wbuf);

// -- packed_linear's bf16 panels (packed_linear_amx.cpp) --
// Rows [m0, m1) of x [M, K] (row stride ldx, K % 32 == 0) as three bf16 terms, x = hi + mid + lo
// exactly, each in the A-tile layout (amx_tiles.h); rows >= M (up to a multiple of 16) are zero.
void bf16_split_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t m0, int64_t m1, uint16_t* hi,
                     uint16_t* mid, uint16_t* lo);
// Rows [0, M) of the split activations (padded to a multiple of 16 rows) against np_here (<=
// kPanelsPerTask) consecutive bf16 panels at w; the first ncols columns go to out (row stride ldo);
// wbuf: np_here * K * 16 bf16 for the relaid-out panels.
void bf16_panels(const uint16_t* hi, const uint16_t* mid, const uint16_t* lo, int64_t M, const uint16_t* w,
                 int64_t np_here, int64_t K, float* out, int64_t ldo, int64_t ncols, uint16_t* wbuf);

}  // namespace amx

}  // namespace minisched::cpu
