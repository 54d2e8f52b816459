// int8_linear on the CPU: out[m, n] = sx[m] * sum_g scales[n, g] * sum_{k in g} q[m, k] * w_q[n, k],
// for int8 weights w_q with one float32 scale per group of G input channels (packed by
// ops.pack_int8_weight) and the rows of x quantized to int16 on the fly, q[m] = round(x[m] * 32767 /
// max|x[m]|), sx[m] = max|x[m]| / 32767 (the reference's quantize_rows_int16).
//
// Why: a small model's CPU decode is bound by reading the weights (SmolLM2-135M: 540 MB of fp32 per
// token; int8 reads a quarter), prefill and large batches by arithmetic. The integer dot-product
// instructions do both: 16-bit x 16-bit products summed in pairs into int32 lanes -- vpmaddwd on
// every AVX2 machine, vpdpwssd with AVX-VNNI (ymm) and AVX512-VNNI (zmm, 32 products per instruction,
// twice the fp32 FMA rate) -- on weights read as int8. The sums are exact; the only rounding beyond
// the weight's is the activations' 16-bit quantization (2^-16 of each row's largest value), so the
// output stays within float32-like error of weight-only int8. (8-bit activations -- vpdpbusd, 4x the
// FMA rate -- lose SmolLM2's greedy tokens: 88-94 % top-1 agreement with fp32 even with SmoothQuant
// scaling, against 98 % for these; benchmarks/RESULTS.md.) One kernel serves every batch size, so a
// row's result does not depend on the batch (the variants agree bit for bit, too).
//
// The work: the rows are quantized once per call, then each task takes a group of consecutive
// 16-column panels and runs the register-blocked micro-kernel (int8_microkernel.h for ymm,
// int8_linear_avx512.cpp for zmm) over all the row blocks while the panels stay in cache. On AMX
// machines 32 rows and more run as int8 tile dot products (int8_linear_amx.cpp), with the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "cpu/cpu_isa.h"
#include "cpu/isa_kernels.h"
#include "cpu/work_split.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "cpu/int8_microkernel.h"
#define MINISCHED_INT8_AVX2 1
#endif

namespace minisched::cpu {
namespace {

constexpr int64_t kPanel = 16;
constexpr float kInt16Max = 32767.f;

// Row m of x to int16 (q, row stride K) and its scale sx[m]; K is a multiple of 32.
void quantize_rows(const float* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, int16_t* q, float* sx) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    int16_t* qr = q + m * K;
    float amax = 0.f;
    int64_t k = 0;
#ifdef MINISCHED_INT8_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    amax = _mm_cvtss_f32(h);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    if (!(amax > 0.f)) {
      std::fill_n(qr, K, int16_t{0});
      sx[m] = 0.f;
      continue;
    }
    const float inv = kInt16Max / amax;
    sx[m] = amax / kInt16Max;
    k = 0;
#ifdef MINISCHED_INT8_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; k + 16 <= K; k += 16) {  // round half to even (the default MXCSR mode), as torch.round
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), vinv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
#endif
    for (; k < K; ++k) qr[k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
  }
}

#ifndef MINISCHED_INT8_AVX2
// Without AVX2 (a non-x86 build): the same sums, one output at a time.
void panel_rows_generic(const int16_t* q, int64_t M, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                        int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < std::min(ncols, np_here * kPanel); ++c) {
      const int64_t p = c / kPanel, j = c % kPanel;
      float total = 0.f;
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t c0 = g * G; c0 < (g + 1) * G; c0 += 256) {
          int32_t acc = 0;
          for (int64_t k = c0; k < std::min((g + 1) * G, c0 + 256); ++k)
            acc += int32_t(q[m * ldq + k]) * int32_t(w[p * K * kPanel + (k / 2) * 32 + 2 * j + k % 2]);
          total = std::fma(static_cast<float>(acc), ws[p * ng * kPanel + g * kPanel + j], total);
        }
      out[m * ldo + c] = total * sx[m];
    }
}
#endif

// AMX (int8_linear_amx.cpp): rows split into hi / lo bytes once, then each task relays out its two
// panels once and runs every row tile against them.
void run_amx(const int16_t* q, const float* sx, int64_t M, int64_t K, int64_t N, int64_t P, int64_t G, const int8_t* w,
             const float* ws, float* o) {
  const int64_t mp = (M + amx::kMinRows - 1) / amx::kMinRows * amx::kMinRows, ng = K / G;
  std::vector<int8_t> hi(static_cast<size_t>(mp * K));
  std::vector<uint8_t> lo(static_cast<size_t>(mp * K));
  parallel_for(0, mp, std::max<int64_t>(1, 65536 / K),
               [&](int64_t m0, int64_t m1) { amx::int8_split_rows(q, M, K, m0, m1, hi.data(), lo.data()); });
  const int64_t np = amx::kPanelsPerTask, groups = (P + np - 1) / np;
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int8_t> wbuf(static_cast<size_t>(np * K * kPanel));
    // Row blocks outer: a block's activations stay in L2 while the task's panels pass.
    for (int64_t mb = 0; mb < M; mb += amx::kRowBlock) {
      const int64_t rows = std::min(amx::kRowBlock, M - mb);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p = g * np, np_here = std::min<int64_t>(np, P - p);
        const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
        amx::int8_panels(hi.data() + mb * K, lo.data() + mb * K, rows, sx + mb, w + p * K * kPanel,
                         ws + p * ng * kPanel, np_here, K, G, o + mb * N + p * kPanel, N, ncols, wbuf.data());
      }
    }
  });
}

void int8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& s_packed, const at::Tensor& out) {
  checks::check_int8_linear(x, w_packed, s_packed, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = w_packed.size(0), G = K / s_packed.size(1);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  std::vector<int16_t> q(static_cast<size_t>(M * K));
  std::vector<float> sx(static_cast<size_t>(M));
  const float* xp = x.const_data_ptr<float>();
  parallel_for(0, M, std::max<int64_t>(1, 65536 / K),
               [&](int64_t m0, int64_t m1) { quantize_rows(xp, x.stride(0), K, m0, m1, q.data(), sx.data()); });

  const int8_t* w = w_packed.const_data_ptr<int8_t>();
  const float* ws = s_packed.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const Isa variant = isa();
  // AMX from a whole tile of rows on, where its 64-channel tiles line up with the scale groups.
  if (variant >= Isa::kAmx && M >= amx::kInt8MinRows && K % 64 == 0 && G % 64 == 0) {
    run_amx(q.data(), sx.data(), M, K, N, P, G, w, ws, o);
    return;
  }
#ifdef MINISCHED_INT8_AVX2
  const int np =
      balanced_panels(P, variant >= Isa::kAvx512 ? avx512::packed_panels_per_call(M) : int8k::panels_per_call(M),
                      at::get_num_threads());
#else
  const int np = 1;
#endif
  const int64_t groups = (P + np - 1) / np, ng = K / G;
  // At least ~64K multiply-adds per task, so a thread wake-up is paid for.
  const int64_t grain = std::max<int64_t>(1, 65536 / (np * kPanel * K * M));
  parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * np, np_here = std::min<int64_t>(np, P - p);
      const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
      const int8_t* wp = w + p * K * kPanel;
      const float* sp = ws + p * ng * kPanel;
      float* op = o + p * kPanel;
#ifdef MINISCHED_INT8_AVX2
      if (variant >= Isa::kAvx512)
        avx512::int8_panel_rows(q.data(), M, K, sx.data(), wp, sp, np_here, K, G, op, N, ncols);
      else if (variant == Isa::kAvx2Vnni)
        avx2vnni::int8_panel_rows(q.data(), M, K, sx.data(), wp, sp, np_here, K, G, op, N, ncols);
      else
        int8k::panel_rows<false>(q.data(), M, K, sx.data(), wp, sp, np_here, K, G, op, N, ncols);
#else
      (void)variant;
      panel_rows_generic(q.data(), M, K, sx.data(), wp, sp, np_here, K, G, op, N, ncols);
#endif
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("int8_linear", &int8_linear); }

}  // namespace minisched::cpu
