// packed_linear on the CPU: out[m, n] = sum_k x[m, k] * w[n, k] (float32), with w pre-packed into
// panels of 16 output columns: w_packed[p, k, j] = w[16 p + j, k] (zero past N).
//
// Why: ATen's sgemm (MKL here) runs the decode shapes of a small model at 10-30 GFLOP/s per core:
// a few activation rows against a wide, short weight (M = 1..64, K = 576..1536). In the packed
// layout one 16-column panel is a contiguous stream, and a register-blocked micro-kernel keeps up to
// 12 ymm accumulators (MT rows x NP panels x 2 halves) busy on the FMA units while each weight
// vector loaded feeds MT FMAs: 60-90 GFLOP/s per core from 4 rows on, and the weights are read once
// per step for up to 6 rows (benchmarks/kernels/bench_linear.py, benchmarks/RESULTS.md "Packed fp32 linear").
// On AVX-512 machines the variant in packed_linear_avx512.cpp does 16 columns per FMA with up to 24
// zmm accumulators; both give the same bits (one FMA chain per output, k in order).
//
// The panels may hold bfloat16 weights (`--quantize bf16`): half the bytes to read per token, widened
// to float32 in registers, so the result is the float32 kernel's on the bf16-rounded weight (and the
// activations stay float32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/cpu_isa.h"
#include "cpu/isa_kernels.h"
#include "cpu/packed_microkernel.h"

namespace minisched::cpu {
namespace {

using packed::kPanel;

// From this many rows on, a task widens its bf16 panels to a float32 buffer once and runs the float32
// kernel on it (the same bits): widening in the micro-kernel costs 2 more instructions per weight
// vector, which pays at few rows (half the bytes read) but costs 20 % of the FMA rate at many.
constexpr int64_t kWidenRows = 16;

// n consecutive bf16 weights to float32 (n % 8 == 0: panels are 16 wide).
void widen_bf16(const packed::bf16_t* src, int64_t n, float* dst) {
#ifdef MINISCHED_PACKED_AVX2
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, packed::load8(src + i));
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = packed::widen(src[i]);
#endif
}

template <typename W>
void run(const at::Tensor& x, const W* w, int64_t P, float* o, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.const_data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const bool wide = use_avx512();
  const int np = wide ? avx512::packed_panels_per_call(M) : packed::panels_per_call(M);
  const int64_t groups = (P + np - 1) / np;
  // At least ~64K FMAs per task, so a thread wake-up is paid for (a 576 x 16 panel at one row is 9K).
  const int64_t grain = std::max<int64_t>(1, 65536 / (np * kPanel * K * M));
  constexpr bool kBf16 = std::is_same_v<W, packed::bf16_t>;
  const bool widen_first = kBf16 && M >= kWidenRows;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(widen_first ? static_cast<size_t>(np * K * kPanel) : 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * np;
      const int64_t np_here = std::min<int64_t>(np, P - p);
      const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
      const W* wp = w + p * K * kPanel;
      // Panel outer, rows inner: the panel (K x 16 weights) stays in L1/L2 while the row blocks pass.
      if (widen_first) {
        widen_bf16(reinterpret_cast<const packed::bf16_t*>(wp), np_here * K * kPanel, buf.data());
        if (wide)
          avx512::packed_panel_rows(xp, M, ldx, buf.data(), np_here, K, o + p * kPanel, N, ncols);
        else
          packed::panel_rows(xp, M, ldx, static_cast<const float*>(buf.data()), np_here, K, o + p * kPanel, N, ncols);
      } else if (wide) {
        avx512::packed_panel_rows(xp, M, ldx, wp, np_here, K, o + p * kPanel, N, ncols);
      } else {
        packed::panel_rows(xp, M, ldx, wp, np_here, K, o + p * kPanel, N, ncols);
      }
    }
  });
}

void packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& out) {
  checks::check_packed_linear(x, w_packed, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = w_packed.size(0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  float* o = out.data_ptr<float>();
  if (w_packed.scalar_type() == at::kBFloat16)
    run(x, reinterpret_cast<const packed::bf16_t*>(w_packed.const_data_ptr<at::BFloat16>()), P, o, N);
  else
    run(x, w_packed.const_data_ptr<float>(), P, o, N);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("packed_linear", &packed_linear); }

}  // namespace minisched::cpu
