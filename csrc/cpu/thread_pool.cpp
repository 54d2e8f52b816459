// The CPU kernels' thread pool (contract and reasons: thread_pool.h).
//
// One job at a time. `state_` holds the job's epoch (high 32 bits) and the next unclaimed chunk (low
// 32); a thread claims chunk i by a compare-and-swap from (epoch, i) to (epoch, i + 1), so a worker
// that read an old job's fields can never claim a chunk of a newer one: its swap fails. When every
// chunk is claimed and finished the caller closes the job (chunk index kClosed) before it writes the
// next job's fields, so a claim that read the new fields under the old epoch fails too.
// `announce_` is the futex word sleeping workers wait on; it changes once per job.
#include "cpu/thread_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define MINISCHED_PAUSE() _mm_pause()
#else
#define MINISCHED_PAUSE() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace minisched::cpu {
namespace {

constexpr uint32_t kClosed = 0xffffffffu;
std::atomic<int64_t> g_spin_us{kDefaultSpinUs};

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

thread_local bool t_in_chunk = false;  // this thread is running a chunk: nested calls run serially

class Pool {
 public:
  // Runs the job on the caller and the workers; returns when every chunk has run.
  void run(int64_t begin, int64_t end, int64_t chunk, int64_t nchunks, int participants, RangeFn f, const void* ctx) {
    grow(participants - 1);
    // The job's fields, then its epoch: a worker reads them only after it saw the epoch.
    f_.store(f, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    chunk_.store(chunk, std::memory_order_relaxed);
    nchunks_.store(nchunks, std::memory_order_relaxed);
    participants_.store(participants, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t epoch = ++epoch_;
    state_.store(uint64_t(epoch) << 32, std::memory_order_release);
    announce_.store(epoch, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&announce_);

    take_chunks(epoch);
    // Wait for chunks other threads started; they are running, so this is short unless one was
    // descheduled, and then yielding lets it have the core back sooner.
    for (int i = 0; done_.load(std::memory_order_acquire) < nchunks; ++i) {
      MINISCHED_PAUSE();
      if ((i & 255) == 255) sched_yield();
    }
    state_.store((uint64_t(epoch) << 32) | kClosed, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_release);  // the close before the next job's fields
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  int workers() const { return started_.load(std::memory_order_relaxed); }

 private:
  void grow(int wanted) {
    for (int id = started_.load(std::memory_order_relaxed) + 1; id <= wanted; ++id) {
      std::thread(&Pool::worker, this, id).detach();  // the pool lives as long as the process
      started_.store(id, std::memory_order_relaxed);
    }
  }

  // Claims and runs the job's chunks until none is left.
  void take_chunks(uint32_t epoch) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if (uint32_t(s >> 32) != epoch) return;
      const RangeFn f = f_.load(std::memory_order_relaxed);
      const void* ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t begin = begin_.load(std::memory_order_relaxed), end = end_.load(std::memory_order_relaxed);
      const int64_t chunk = chunk_.load(std::memory_order_relaxed), nchunks = nchunks_.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);  // fields read before the claim is checked
      const uint32_t i = uint32_t(s);
      if (i == kClosed || int64_t(i) >= nchunks) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      const int64_t b = begin + int64_t(i) * chunk;
      t_in_chunk = true;
      try {
        c10::ParallelGuard guard(true);  // torch code inside a chunk runs serially, as in at::parallel_for
        f(ctx, b, std::min(end, b + chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      t_in_chunk = false;
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void worker(int id) {
    uint32_t seen = announce_.load(std::memory_order_acquire);
    bool spin = false;  // spin only after taking part in a job: an idle pool's workers sleep
    for (;;) {
      wait_for_job(seen, spin);
      seen = announce_.load(std::memory_order_acquire);
      spin = id < participants_.load(std::memory_order_relaxed);
      if (spin) take_chunks(seen);
    }
  }

  void wait_for_job(uint32_t seen, bool spin) {
    const int64_t budget = spin ? g_spin_us.load(std::memory_order_relaxed) * 1000 : 0;
    if (budget > 0) {
      const int64_t t0 = now_ns();
      for (int i = 1;; ++i) {
        if (announce_.load(std::memory_order_acquire) != seen) return;
        MINISCHED_PAUSE();
        if ((i & 63) == 0) {
          if (now_ns() - t0 > budget) break;
          // Give the core away if another thread (a descheduled chunk, another process) wants it.
          if ((i & 255) == 0) sched_yield();
        }
      }
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (announce_.load(std::memory_order_seq_cst) == seen) futex_wait(&announce_, seen);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  std::atomic<uint64_t> state_{uint64_t(kClosed)};
  std::atomic<uint32_t> announce_{0};
  uint32_t epoch_ = 0;  // the caller's copy (jobs are posted under g_busy)
  std::atomic<int> sleepers_{0}, started_{0}, participants_{0};
  std::atomic<RangeFn> f_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, chunk_{1}, nchunks_{0}, done_{0};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

// Leaked on purpose: detached workers use it until the process ends. fork() gives the child a new
// one (the parent's workers do not exist there).
Pool* g_pool = new Pool();
std::mutex* g_busy = new std::mutex();
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, [] {
  g_pool = new Pool();
  g_busy = new std::mutex();
});

}  // namespace

void parallel_run(int64_t begin, int64_t end, int64_t grain, RangeFn f, const void* ctx) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  const int64_t threads = at::get_num_threads();
  if (n <= grain || n == 1 || threads <= 1 || t_in_chunk || at::in_parallel_region()) {
    c10::ParallelGuard guard(true);
    return f(ctx, begin, end);
  }
  std::unique_lock<std::mutex> lock(*g_busy, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread's job is running: do this one here
    c10::ParallelGuard guard(true);
    return f(ctx, begin, end);
  }
  // at::parallel_for's chunks: one per thread, ceil(n / threads') long, threads' <= ceil(n / grain).
  const int64_t used = grain > 0 ? std::min(threads, (n + grain - 1) / grain) : threads;
  const int64_t chunk = (n + used - 1) / used;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  g_pool->run(begin, end, chunk, nchunks, int(std::min<int64_t>(used, nchunks)), f, ctx);
}

int64_t spin_us() { return g_spin_us.load(std::memory_order_relaxed); }
void set_spin_us(int64_t us) { g_spin_us.store(std::max<int64_t>(0, us), std::memory_order_relaxed); }
int pool_workers() { return g_pool->workers(); }

}  // namespace minisched::cpu
