// gguf_linear on the CPU: out[m, n] = sum_k x[m, k] * w[n, k] (float32), with w kept in a GGUF
// file's own block format (Q4_0, Q4_1, Q8_0; repacked into 16-row panels by ops.pack_gguf_weight)
// and dequantized to float32 as the kernel reads it. The formats and the layout: gguf_microkernel.h.
//
// Why: single-stream decode reads every weight once per token. The bundled SmolLM2 ships as Q4_1,
// and the float32 model is that file dequantized: running on the blocks computes the same weights
// from 0.625 bytes per weight instead of 4 (the Q8_0 head: 1.06). The dequantized values are the float32
// model's bits and every output is one FMA chain over k in order, as in packed_linear, so the
// outputs are packed_linear's on the dequantized weight, bit for bit, at every row count and ISA.
//
// The work: each task takes a group of consecutive panels. Up to kWidenRows - 1 rows, the
// micro-kernel dequantizes each weight vector in registers and feeds it to several rows' FMAs (8
// rows of one panel-block half with AVX2, all 16 rows with AVX-512: gguf_linear_avx512.cpp). From
// kWidenRows rows on (prefill, large batches: bound by arithmetic) the task dequantizes its panels
// to a float32 buffer once and runs packed_linear's micro-kernel (AVX2 or AVX-512) on it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "cpu/cpu_isa.h"
#include "cpu/gguf_microkernel.h"
#include "cpu/isa_kernels.h"
#include "cpu/packed_microkernel.h"
#include "cpu/work_split.h"

namespace minisched::cpu {
namespace {

using ggufk::kBlock;
using ggufk::kPanel;

// From this many rows on a task dequantizes its panels once to float32 (benchmarks/kernels/
// bench_gguf_linear.py): below it, reading the blocks in the micro-kernel saves more bandwidth than
// the repeated dequantization costs.
constexpr int64_t kWidenRows = 16;

template <int QT>
void run(const at::Tensor& x, const uint8_t* w, int64_t P, float* o, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock;
  const float* xp = x.const_data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const bool wide = use_avx512();
#ifdef MINISCHED_GGUF_AVX2
  const bool widen_first = M >= kWidenRows;
#else
  const bool widen_first = true;  // the generic build: dequantize, then packed_linear's kernel
#endif
  int np;
  if (widen_first)
    np = wide ? avx512::packed_panels_per_call(M) : packed::panels_per_call(M);
  else
#ifdef MINISCHED_GGUF_AVX2
    np = wide ? avx512::gguf_panels_per_call(M) : ggufk::panels_per_call(M);
#else
    np = 1;
#endif
  np = balanced_panels(P, np, at::get_num_threads());
  const int64_t groups = (P + np - 1) / np;
  // At least ~64K FMAs per task, so a thread wake-up is paid for.
  const int64_t grain = std::max<int64_t>(1, 65536 / (np * kPanel * K * M));
  constexpr int64_t S = ggufk::panel_block_bytes(QT);
  parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(widen_first ? static_cast<size_t>(np * K * kPanel) : 0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * np;
      const int64_t np_here = std::min<int64_t>(np, P - p);
      const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
      const uint8_t* wp = w + p * KB * S;
      float* op = o + p * kPanel;
      if (widen_first) {
        ggufk::dequant_panels<QT>(wp, np_here, KB, buf.data());
        if (wide)
          avx512::packed_panel_rows(xp, M, ldx, buf.data(), np_here, K, op, N, ncols);
        else
          packed::panel_rows(xp, M, ldx, static_cast<const float*>(buf.data()), np_here, K, op, N, ncols);
      } else {
#ifdef MINISCHED_GGUF_AVX2
        if (wide)
          avx512::gguf_panel_rows(QT, xp, M, ldx, wp, np_here, KB, op, N, ncols);
        else
          ggufk::panel_rows<QT>(xp, M, ldx, wp, np_here, KB, op, N, ncols);
#endif
      }
    }
  });
}

void gguf_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t qtype, const at::Tensor& out) {
  checks::check_gguf_linear(x, w_packed, qtype, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = w_packed.size(0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  const uint8_t* w = w_packed.const_data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (qtype) {
    case ggufk::kQ4_0:
      return run<ggufk::kQ4_0>(x, w, P, o, N);
    case ggufk::kQ4_1:
      return run<ggufk::kQ4_1>(x, w, P, o, N);
    default:
      return run<ggufk::kQ8_0>(x, w, P, o, N);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("gguf_linear", &gguf_linear); }

}  // namespace minisched::cpu
