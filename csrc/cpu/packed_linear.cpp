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
// activations stay float32). On AMX machines bf16 panels from 16 rows on run as tile dot products
// (packed_linear_amx.cpp): the same products, float32 sums in another order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "cpu/cpu_isa.h"
#include "cpu/isa_kernels.h"
#include "cpu/work_split.h"
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

// bf16 panels on AMX (packed_linear_amx.cpp): the rows split into three bf16 terms once, then each
// task relays out its two panels once and runs every row tile against them.
void run_amx_bf16(const at::Tensor& x, const packed::bf16_t* w, int64_t P, float* o, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t mp = (M + amx::kMinRows - 1) / amx::kMinRows * amx::kMinRows;
  std::vector<uint16_t> terms(static_cast<size_t>(3 * mp * K));
  uint16_t *hi = terms.data(), *mid = hi + mp * K, *lo = mid + mp * K;
  const float* xp = x.const_data_ptr<float>();
  parallel_for(0, mp, std::max<int64_t>(1, 16384 / K),
               [&](int64_t m0, int64_t m1) { amx::bf16_split_rows(xp, x.stride(0), M, K, m0, m1, hi, mid, lo); });
  const int64_t np = amx::kPanelsPerTask, groups = (P + np - 1) / np;
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint16_t> wbuf(static_cast<size_t>(np * K * kPanel));
    // Row blocks outer: a block's activations stay in L2 while the task's panels pass.
    for (int64_t mb = 0; mb < M; mb += amx::kRowBlock) {
      const int64_t rows = std::min(amx::kRowBlock, M - mb), off = mb * K;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p = g * np, np_here = std::min<int64_t>(np, P - p);
        const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
        amx::bf16_panels(hi + off, mid + off, lo + off, rows, w + p * K * kPanel, np_here, K, o + mb * N + p * kPanel,
                         N, ncols, wbuf.data());
      }
    }
  });
}

template <typename W>
void run(const at::Tensor& x, const W* w, int64_t P, float* o, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  if constexpr (std::is_same_v<W, packed::bf16_t>) {
    if (isa() >= Isa::kAmx && M >= amx::kMinRows && K % 32 == 0) return run_amx_bf16(x, w, P, o, N);
  }
  const float* xp = x.const_data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const bool wide = use_avx512();
  const int np =
      balanced_panels(P, wide ? avx512::packed_panels_per_call(M) : packed::panels_per_call(M), at::get_num_threads());
  const int64_t groups = (P + np - 1) / np;
  // At least ~64K FMAs per task, so a thread wake-up is paid for (a 576 x 16 panel at one row is 9K).
  const int64_t grain = std::max<int64_t>(1, 65536 / (np * kPanel * K * M));
  constexpr bool kBf16 = std::is_same_v<W, packed::bf16_t>;
  const bool widen_first = kBf16 && M >= kWidenRows;
  parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
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
