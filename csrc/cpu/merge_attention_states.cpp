// merge_attention_states on the CPU: combine two partial attentions over disjoint KV sets,
// v [N, H, D] with lse [N, H] (float32, natural log), exactly as minisched.reference:
//   m = max(lse_a, lse_b) (0 when infinite), w = exp(lse - m),
//   v_out = (v_a w_a + v_b w_b) / (w_a + w_b or 1), lse_out = m + log(w_a + w_b).
// An empty side (lse = -inf) gets weight 0; both empty gives v_out = 0, lse_out = -inf.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "checks.h"
#include "cpu/thread_pool.h"
#include "cpu/attention_cpu.h"

namespace minisched::cpu {
namespace {

template <typename scalar_t>
void merge_rows(const scalar_t* va, const float* la, const scalar_t* vb, const float* lb, scalar_t* vo, float* lo,
                int64_t rows, int64_t d) {
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float a = la[r], b = lb[r];
      float m = (std::isnan(a) || std::isnan(b)) ? std::numeric_limits<float>::quiet_NaN() : std::max(a, b);
      if (std::isinf(m)) m = 0.f;
      const float wa = std::exp(a - m), wb = std::exp(b - m);
      const float total = wa + wb;
      const float inv = 1.f / (total > 0.f ? total : 1.f);
      const scalar_t* pa = va + r * d;
      const scalar_t* pb = vb + r * d;
      scalar_t* po = vo + r * d;
      for (int64_t i = 0; i < d; ++i)
        po[i] = static_cast<scalar_t>((static_cast<float>(pa[i]) * wa + static_cast<float>(pb[i]) * wb) * inv);
      lo[r] = m + std::log(total);
    }
  });
}

void merge_attention_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b,
                            const at::Tensor& lse_b, const at::Tensor& v_out, const at::Tensor& lse_out) {
  checks::check_merge_attention_states(v_a, lse_a, v_b, lse_b, v_out, lse_out);
  const int64_t rows = v_a.size(0) * v_a.size(1), d = v_a.size(2);
  if (rows == 0) return;
  dispatch_float(v_a.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    merge_rows<scalar_t>(v_a.const_data_ptr<scalar_t>(), lse_a.const_data_ptr<float>(), v_b.const_data_ptr<scalar_t>(),
                         lse_b.const_data_ptr<float>(), v_out.data_ptr<scalar_t>(), lse_out.data_ptr<float>(), rows, d);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minisched, CPU, m) { m.impl("merge_attention_states", &merge_attention_states); }

}  // namespace minisched::cpu
