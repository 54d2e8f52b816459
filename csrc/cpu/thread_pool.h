// The CPU kernels' own thread pool: parallel_for with at::parallel_for's contract, and a wait policy
// chosen at run time.
//
// Why not at::parallel_for: torch's runs on libgomp, whose threads either spin on every fork/join
// (the default, which on shared cores made decode tenfold slower) or, under the OMP_WAIT_POLICY=PASSIVE
// minisched sets, sleep in the kernel between regions. A decode step opens ~150 regions with tens of
// microseconds of Python between them, so every region paid a wake-up: GOMP_SPINCOUNT=3000 measured
// 1.33x at one stream (benchmarks/RESULTS.md, Peers). libgomp reads that once, at load. Here:
//   - an idle worker spins for spin_us() microseconds (pause + a yield now and then) before it sleeps
//     on a futex, so back-to-back regions find it awake and a quiet gap costs nothing after that;
//   - the chunks are at::parallel_for's (the range cut into one contiguous chunk per thread, the
//     same boundaries), but any thread takes any chunk that nobody has started: a worker that is
//     asleep, or descheduled by another process, delays nobody; the caller runs them itself. Only a
//     chunk already started is waited for. Which thread runs a chunk never changes its bits.
//   - at::get_num_threads() (torch.set_num_threads, the engine's num_threads) sets how many threads
//     take part, as for torch's own kernels.
// A call from inside a chunk, from a second thread while the pool is busy, or with one thread runs
// serially on the caller. An exception thrown by a chunk is rethrown on the caller once every started
// chunk has finished. After fork() the child starts a fresh pool.
#pragma once

#include <cstdint>

namespace minisched::cpu {

using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// f(ctx, b, e) over [begin, end) in chunks; serial when end - begin <= grain (at::parallel_for's rule).
void parallel_run(int64_t begin, int64_t end, int64_t grain, RangeFn f, const void* ctx);

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_run(begin, end, grain, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); }, &f);
}

// How long an idle worker spins before it sleeps, in microseconds (0: sleep at once). Process-wide.
int64_t spin_us();
void set_spin_us(int64_t us);
constexpr int64_t kDefaultSpinUs = 50;

// Worker threads started so far (they are started on first need and kept).
int pool_workers();

}  // namespace minisched::cpu
