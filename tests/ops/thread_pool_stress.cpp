// A stress program for csrc/cpu/thread_pool.cpp, built and run by tests/ops/test_thread_pool.py (the
// kernels never throw inside a chunk, nest, or race from two threads, so these paths are driven here).
// Prints one line per failure and exits 1 if any.
#include <ATen/Parallel.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/thread_pool.h"

using minisched::cpu::parallel_for;

namespace {

std::atomic<int> g_fails{0};

void check(bool ok, const std::string& what) {
  if (ok) return;
  if (g_fails.fetch_add(1) < 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

// Every index once, in at::parallel_for's chunks (one per thread, ceil(n / used) long), or in one
// chunk where `may_be_serial` (the pool was busy with another caller's job).
void one_call(std::mt19937& rng, int threads, bool may_be_serial = false) {
  const int64_t begin = rng() % 5, n = rng() % 300, grain = rng() % 9;
  std::vector<std::atomic<int>> hits(n);
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  parallel_for(begin, begin + n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i - begin].fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    chunks.emplace_back(b, e);
  });
  for (int64_t i = 0; i < n; ++i) check(hits[i].load() == 1, "index " + std::to_string(i) + " not run once");
  if (n == 0) return check(chunks.empty(), "an empty range ran a chunk");
  const bool serial = n <= grain || n == 1 || threads <= 1 ||
                      (may_be_serial && chunks.size() == 1 && chunks[0] == std::make_pair(begin, begin + n));
  const int64_t used = serial ? 1 : std::min<int64_t>(threads, grain > 0 ? (n + grain - 1) / grain : threads);
  const int64_t chunk = (n + used - 1) / used;
  check(int64_t(chunks.size()) == (n + chunk - 1) / chunk, "chunk count for n=" + std::to_string(n));
  for (const auto& [b, e] : chunks)
    check((b - begin) % chunk == 0 && e == std::min(begin + n, b + chunk), "chunk bounds for n=" + std::to_string(n));
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  // 1. Thread counts, spins and ranges mixed, with idle gaps now and then (workers asleep).
  for (int it = 0; it < 4000; ++it) {
    const int threads = 1 + int(rng() % 4);
    at::set_num_threads(threads);
    minisched::cpu::set_spin_us(it % 3 == 0 ? 0 : 50);
    if (it % 97 == 0) usleep(300);
    one_call(rng, threads);
  }
  check(minisched::cpu::pool_workers() <= 3, "more workers than threads - 1");

  // 2. An exception inside a chunk reaches the caller after the other chunks ran; the pool stays usable.
  at::set_num_threads(4);
  for (int it = 0; it < 200; ++it) {
    std::atomic<int> ran{0};
    bool caught = false;
    try {
      parallel_for(0, 64, 1, [&](int64_t b, int64_t e) {
        ran.fetch_add(int(e - b));
        if (b <= 40 && 40 < e) throw std::runtime_error("chunk 40");
      });
    } catch (const std::runtime_error& err) {
      caught = std::string(err.what()) == "chunk 40";
    }
    check(caught, "the chunk's exception did not reach the caller");
    check(ran.load() == 64, "chunks were skipped after an exception");
    one_call(rng, 4);
  }

  // 3. A call from inside a chunk runs serially, on the thread that runs the chunk.
  for (int it = 0; it < 200; ++it) {
    std::atomic<int> total{0};
    parallel_for(0, 8, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const auto me = std::this_thread::get_id();
        int calls = 0;
        parallel_for(0, 100, 1, [&](int64_t b2, int64_t e2) {
          check(std::this_thread::get_id() == me && b2 == 0 && e2 == 100, "a nested call was not serial");
          total.fetch_add(int(e2 - b2));
          ++calls;
        });
        check(calls == 1, "a nested call ran in pieces");
      }
    });
    check(total.load() == 800, "nested calls lost work");
  }

  // 4. Four threads calling at once: one gets the pool, the others run on themselves; all complete.
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([c] {
      std::mt19937 r(c);
      for (int it = 0; it < 1500; ++it) one_call(r, at::get_num_threads(), true);
    });
  for (auto& t : callers) t.join();

  // 5. After fork the child's pool works (the parent's workers do not exist there).
  const pid_t pid = fork();
  if (pid == 0) {
    std::mt19937 r(7);
    at::set_num_threads(3);
    for (int it = 0; it < 300; ++it) one_call(r, 3);
    _exit(g_fails.load() == 0 ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child failed");

  if (g_fails.load() == 0) std::printf("ok\n");
  return g_fails.load() == 0 ? 0 : 1;
}
