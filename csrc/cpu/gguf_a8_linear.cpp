// gguf_a8_linear on the CPU: out[m, n] = sum_k x^[m, k] * w[n, k] for w a GGUF file's blocks (Q4_0, Q4_1,
// Q8_0; ops.pack_gguf_a8_weight) and x^ the rows of x rounded to 8 bits per block of 32 channels
// (reference.quantize_a8: x^ = dx * xq, dx = max |x| / 127). The arithmetic and the layout:
// gguf_a8_microkernel.h.
//
// Why: gguf_linear computes the float32 model's bits from the file's blocks, and for that dequantizes
// every weight to float32 and runs one FMA per weight and row; at one stream on few cores that
// arithmetic, not the ~96 MB a SmolLM2 token reads, bounds it (benchmarks/RESULTS.md). llama.cpp makes
// the other trade, and this op is it: with the activations in int8 per block, one vpdpbusd multiplies 4
// channels of 16 rows (64 products; AVX2 without VNNI: vpmaddubsw + vpmaddwd), the weights' nibbles
// used as they are. The sums are exact integers; the result differs from gguf_linear's by the
// activations' rounding (half a step of max |x| / 127 per block of 32), so it is close to the float32
// model, not its bits: an option (`--quantize gguf-a8`), never the default.
//
// The work: the rows are quantized once per call (every thread reads them), then each task takes a
// group of consecutive 16-row panels and runs the register-blocked micro-kernel over all the row
// blocks. Every variant does the same float operations in the same order: the same bits on every ISA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "cpu/cpu_isa.h"
#include "cpu/gguf_a8_microkernel.h"
#include "cpu/isa_kernels.h"
#include "cpu/work_split.h"

#ifndef MINISCHED_GGUF_A8_AVX2
#include "cpu/gguf_microkernel.h"  // ggufk::load_half, for the generic path
#endif

namespace minisched::cpu {
namespace {

using a8k::kBlock;
using a8k::kPanel;

// Rows [m0, m1) of x [M, K] (row stride ldx) to xq [M, K], dx and sq [M, K / 32] (quantize_a8's float32
// steps: dx = amax / 127, xq = round half to even of x * (127 / amax); a block holding inf or NaN: xq = 0,
// dx = NaN).
void quantize_rows(const float* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, int8_t* xq, float* dx, int32_t* sq) {
  const int64_t KB = K / kBlock;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < KB; ++b) {
      const float* xb = x + m * ldx + b * kBlock;
      int8_t* qb = xq + m * K + b * kBlock;
      const int64_t i = m * KB + b;
#ifdef MINISCHED_GGUF_A8_AVX2
      const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
      __m256 v[4], mx = _mm256_setzero_ps();
      int finite = 0xFF;
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        const __m256 a = _mm256_andnot_ps(sign, v[j]);
        mx = _mm256_max_ps(mx, a);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));  // false for inf and NaN
      }
      if (finite != 0xFF) {
        std::fill_n(qb, kBlock, int8_t{0});
        dx[i] = std::numeric_limits<float>::quiet_NaN();
        sq[i] = 0;
        continue;
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float amax = _mm_cvtss_f32(h);
      dx[i] = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];  // round half to even (the default MXCSR mode), as torch.round
      for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      sq[i] = _mm_cvtsi128_si32(s4);
#else
      float amax = 0.f;
      bool finite = true;
      for (int64_t c = 0; c < kBlock; ++c) {
        finite = finite && std::isfinite(xb[c]);
        amax = std::max(amax, std::fabs(xb[c]));
      }
      if (!finite) {
        std::fill_n(qb, kBlock, int8_t{0});
        dx[i] = std::numeric_limits<float>::quiet_NaN();
        sq[i] = 0;
        continue;
      }
      dx[i] = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t total = 0;
      for (int64_t c = 0; c < kBlock; ++c) {
        qb[c] = static_cast<int8_t>(std::clamp(std::nearbyint(xb[c] * inv), -127.f, 127.f));
        total += qb[c];
      }
      sq[i] = total;
#endif
    }
}

#ifndef MINISCHED_GGUF_A8_AVX2
// Without AVX2 (a non-x86 build): the same integer sums and float steps, one output at a time.
void panel_rows_generic(int qtype, const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB,
                        float* out, int64_t ldo, int64_t ncols) {
  const int64_t S = a8k::panel_block_bytes(qtype);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < std::min(ncols, np_here * kPanel); ++c) {
      const int64_t p = c / kPanel, r = c % kPanel;
      float acc = 0.f;
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* blk = wp + (p * KB + b) * S;
        const uint8_t* qs = blk + a8k::quant_offset(qtype);
        const int8_t* xq = a.q + m * a.K + b * kBlock;
        int32_t s = 0;
        for (int64_t ch = 0; ch < kBlock; ++ch) {
          int32_t wq;
          if (qtype == a8k::kQ8_0) {
            wq = static_cast<int8_t>(qs[(ch / 4) * 64 + r * 4 + ch % 4]);
          } else {
            const int64_t j = ch % 16;
            const uint8_t byte = qs[(j / 4) * 64 + r * 4 + j % 4];
            wq = (ch < 16 ? (byte & 0xF) : (byte >> 4)) - (qtype == a8k::kQ4_0 ? 8 : 0);
          }
          s += wq * xq[ch];
        }
        const int64_t i = m * KB + b;
        const float d = ggufk::load_half(blk + 2 * r);
        acc = std::fma(d * a.dx[i], static_cast<float>(s), acc);
        if (qtype == a8k::kQ4_1) acc = std::fma(ggufk::load_half(blk + 32 + 2 * r), a.dx[i] * float(a.sq[i]), acc);
      }
      out[m * ldo + c] = acc;
    }
}
#endif

void gguf_a8_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t qtype, const at::Tensor& out) {
  checks::check_gguf_a8_linear(x, w_packed, qtype, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = w_packed.size(0), KB = K / kBlock;
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> dx(static_cast<size_t>(M * KB));
  std::vector<int32_t> sq(static_cast<size_t>(M * KB));
  const float* xp = x.const_data_ptr<float>();
  parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(xp, x.stride(0), K, m0, m1, xq.data(), dx.data(), sq.data());
  });
  const A8Rows a{xq.data(), dx.data(), sq.data(), K};

  const auto* w = reinterpret_cast<const uint8_t*>(w_packed.const_data_ptr<int32_t>());
  float* o = out.data_ptr<float>();
  const Isa variant = isa();
  const int qt = static_cast<int>(qtype);
#ifdef MINISCHED_GGUF_A8_AVX2
  const int np_max = variant >= Isa::kAvx512 ? avx512::a8_panels_per_call(M) : a8k::panels_per_call(M);
#else
  const int np_max = 1;
#endif
  const int np = balanced_panels(P, np_max, at::get_num_threads());
  const int64_t groups = (P + np - 1) / np, S = a8k::panel_block_bytes(qt);
  // At least ~256K products per task (4x gguf_linear's FMAs: a product costs a quarter), so a thread
  // wake-up is paid for.
  const int64_t grain = std::max<int64_t>(1, 262144 / (np * kPanel * K * M));
  parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * np, np_here = std::min<int64_t>(np, P - p);
      const int64_t ncols = std::min(np_here * kPanel, N - p * kPanel);
      const uint8_t* wp = w + p * KB * S;
      float* op = o + p * kPanel;
#ifdef MINISCHED_GGUF_A8_AVX2
      if (variant >= Isa::kAvx512)
        avx512::gguf_a8_panel_rows(qt, a, M, wp, np_here, KB, op, N, ncols);
      else if (variant == Isa::kAvx2Vnni)
        avx2vnni::gguf_a8_panel_rows(qt, a, M, wp, np_here, KB, op, N, ncols);
      else
        a8k::panel_rows<false>(qt, a, M, wp, np_here, KB, op, N, ncols);
#else
      panel_rows_generic(qt, a, M, wp, np_here, KB, op, N, ncols);
#endif
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("gguf_a8_linear", &gguf_a8_linear); }

}  // namespace minisched::cpu
