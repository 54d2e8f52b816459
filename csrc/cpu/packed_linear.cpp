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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "cpu/cpu_isa.h"
#include "cpu/isa_kernels.h"
#include "cpu/packed_microkernel.h"

namespace minisched::cpu {
namespace {

using packed::kPanel;

void packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& out) {
  checks::check_packed_linear(x, w_packed, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = w_packed.size(0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  const float* xp = x.const_data_ptr<float>();
  const float* w = w_packed.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const bool wide = use_avx512();
  const int np = wide ? avx512::packed_panels_per_call(M) : packed::panels_per_call(M);
  const int64_t groups = (P + np - 1) / np;
  // At least ~64K FMAs per task, so a thread wake-up is paid for (a 576 x 16 panel at one row is 9K).
  const int64_t grain = std::max<int64_t>(1, 65536 / (np * kPanel * K * M));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * np;
      const int64_t np_here = std::min<int64_t>(np, P - p);
      const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
      const float* wp = w + p * K * kPanel;
      // Panel outer, rows inner: the panel (K x 16 floats) stays in L1/L2 while the row blocks pass.
      if (wide)
        avx512::packed_panel_rows(xp, M, ldx, wp, np_here, K, o + p * kPanel, N, ncols);
      else
        packed::panel_rows(xp, M, ldx, wp, np_here, K, o + p * kPanel, N, ncols);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("packed_linear", &packed_linear); }

}  // namespace minisched::cpu
