// The (rows, panels) blocks of the AVX-512 micro-kernels (packed_linear_avx512.cpp,
// int8_linear_avx512.cpp) and the one switch from a block's run-time shape to the template that
// computes it. Plain templates with no vector code: included before a variant's pragma, so the code
// they call is the variant's own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "cpu/isa_kernels.h"

namespace minisched::cpu::avx512 {

constexpr int kMaxPanels = 8;  // packed_panels_per_call's largest

// The 16-lane store mask (an __mmask16's bits) of panel p of a call whose panels hold `ncols` valid
// columns: all 16 lanes but in the last, partial panel (the AVX-512 and AMX kernels' masked stores).
inline uint16_t panel_mask(int64_t ncols, int p) {
  const int64_t c = std::clamp<int64_t>(ncols - int64_t{p} * 16, 0, 16);
  return static_cast<uint16_t>((1u << c) - 1u);
}

// The shapes packed_panels_per_call asks for (at most 24 accumulators of the 32 zmm registers).
template <int MT, int NP>
constexpr bool kBlockShape = MT == 1 || (MT <= 6 && NP <= 4) || NP <= 3;

namespace detail {
template <int MT, int NP, typename F>
inline bool run_shape(F& f) {
  if constexpr (kBlockShape<MT, NP>) {
    f.template operator()<MT, NP>();
    return true;
  }
  return false;
}
template <int MT, typename F, int... P>
inline bool run_panels(int64_t np, F& f, std::integer_sequence<int, P...>) {
  return ((np == P + 1 && run_shape<MT, P + 1>(f)) || ...);
}
template <typename F, int... R>
inline bool run_rows(int64_t mt, int64_t np, F& f, std::integer_sequence<int, R...>) {
  return ((mt == R + 1 && run_panels<R + 1>(np, f, std::make_integer_sequence<int, kMaxPanels>{})) || ...);
}
}  // namespace detail

// f.template operator()<MT, NP>() for mt rows (1..kPackedMaxRows) and np panels (1..kMaxPanels);
// any other shape is a caller bug (packed_panels_per_call never asks for it): trap.
template <typename F>
inline void with_block_shape(int64_t mt, int64_t np, F&& f) {
  if (!detail::run_rows(mt, np, f, std::make_integer_sequence<int, kPackedMaxRows>{})) __builtin_trap();
}

}  // namespace minisched::cpu::avx512
