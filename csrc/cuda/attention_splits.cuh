// Split-KV for the paged attention kernel (attention_kernel.cu): how many splits a launch takes
// (choose_splits, host) and the log-sum-exp merge of their partials (merge_splits_kernel). Included
// by attention_kernel.cu only (anonymous namespace: internal to that translation unit).
#pragma once

#include <algorithm>
#include <cmath>

#include "cuda/attention_tile_map.cuh"
#include "cuda/attention_utils.cuh"

namespace minisched::cuda {
namespace {

// Merge the splits' partial (out, lse) by log-sum-exp over the same (tile, kv head) grid as the
// attention kernel, so exactly the rows some tile computed are written (a row of an invalid
// qo range has no tile, and its output stays untouched, as with one split). All splits empty
// (an empty KV range) gives out = 0, lse = -inf; a NaN partial (bad page table) stays NaN.
template <typename T, int D>
__global__ void __launch_bounds__(256) merge_splits_kernel(const AttentionParams p, int rows_tile) {
  const TileLoc loc = locate_tile(p, blockIdx.x);
  if (!loc.ok) return;
  const int g = p.group, kvh = blockIdx.y;
  const int row_beg = loc.tile * rows_tile;
  const int rows_valid = min(rows_tile, loc.qo_len * g - row_beg);
  const long long split_stride = (long long)p.num_qo * p.num_heads;
  T* out = reinterpret_cast<T*>(p.out);
  for (int idx = threadIdx.x; idx < rows_valid * (D / 4); idx += blockDim.x) {
    const int pr = row_beg + idx / (D / 4);
    const int d = (idx % (D / 4)) * 4;
    const long long rh = (long long)(loc.q_start + pr / g) * p.num_heads + kvh * g + pr % g;
    float m = -INFINITY;
    for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.part_lse[s * split_stride + rh]);
    const float m_use = m == -INFINITY ? 0.f : m;
    float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = __expf(p.part_lse[s * split_stride + rh] - m_use);
      const float4 v = *reinterpret_cast<const float4*>(p.part_out + (s * split_stride + rh) * D + d);
      sum += w;
      acc[0] += w * v.x;
      acc[1] += w * v.y;
      acc[2] += w * v.z;
      acc[3] += w * v.w;
    }
    const float inv = sum > 0.f ? 1.f / sum : (sum == 0.f ? 0.f : sum);  // NaN sum stays NaN
    uint2 packed;
    packed.x = pack2<T>(acc[0] * inv, acc[1] * inv);
    packed.y = pack2<T>(acc[2] * inv, acc[3] * inv);
    *reinterpret_cast<uint2*>(out + rh * D + d) = packed;
    if (d == 0 && p.lse != nullptr) p.lse[rh] = m_use + __logf(sum);
  }
}

// Fewest splits whose CTA count fills the resident slots evenly (>= 90% of the last wave), each
// split keeping at least 2 KV tiles of block_n tokens (so the two-stage pipeline still overlaps);
// else the best fill.
inline int choose_splits(long long base_ctas, int slots, long long est_kv_len, int block_n) {
  if (base_ctas <= 0 || slots <= 0) return 1;
  const int max_splits = int(std::max<long long>(1, std::min<long long>(32, est_kv_len / (2 * block_n))));
  int best = 1;
  double best_eff = 0.0;
  for (int s = 1; s <= max_splits; ++s) {
    const long long ctas = base_ctas * s;
    const long long waves = (ctas + slots - 1) / slots;
    const double eff = double(ctas) / double(waves * slots);
    if (eff >= 0.9) return s;
    if (eff > best_eff + 1e-9) {
      best_eff = eff;
      best = s;
    }
  }
  return best;
}

}  // namespace
}  // namespace minisched::cuda
