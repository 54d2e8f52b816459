// How the linears' column panels are split over threads (packed_linear, int8_linear, gguf_linear).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace minisched::cpu {

// Panels per task for P panels over `threads` threads: at most np_max (the micro-kernel's widest
// call) and at least half of it, the count that leaves the busiest thread the fewest panels
// (parallel_for hands each thread ceil(groups / threads) consecutive groups), the wider on ties.
// Why: at one row the AVX-512 kernels take 8 panels a call, and a 576-column output (36 panels) was
// 5 tasks, 3 on one thread and 2 on the other; 6 panels a call make it 3 and 3. Every output is
// still one FMA chain over k, whatever task computes it: the bits do not change.
inline int balanced_panels(int64_t P, int np_max, int threads) {
  if (threads <= 1 || np_max <= 1 || P <= 0) return np_max;
  int best = np_max;
  int64_t best_load = std::numeric_limits<int64_t>::max();
  for (int np = np_max; np >= std::max(1, (np_max + 1) / 2); --np) {
    const int64_t groups = (P + np - 1) / np;
    const int64_t load = std::min<int64_t>(P, (groups + threads - 1) / threads * np);
    if (load < best_load) {
      best_load = load;
      best = np;
    }
  }
  return best;
}

}  // namespace minisched::cpu
