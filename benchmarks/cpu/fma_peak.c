// The machine's float32 FMA peak, measured: each thread runs independent FMA chains on registers only
// (more than the FMA latency x two ports needs; ymm: 12, as AVX2 has 16 registers and two hold the
// constants; zmm: 16 of 32), so nothing but the FMA units limits it.
// Built and loaded by bench_roofline.py (gcc -O2 -fopenmp); not part of minisched.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS_YMM 12
#define CHAINS 16

// FMAs per chain per thread; returns a value that depends on every chain (so none is optimised away).
__attribute__((target("avx2,fma"))) float fma_ymm(int64_t iters, int threads) {
  float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m256 acc[CHAINS_YMM];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS_YMM; ++i) acc[i] = _mm256_set1_ps((float)i);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS_YMM; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    }
    __m256 s = acc[0];
    for (int i = 1; i < CHAINS_YMM; ++i) s = _mm256_add_ps(s, acc[i]);
    float out[8];
    _mm256_storeu_ps(out, s);
    total += out[0];
  }
  return total;
}

__attribute__((target("avx512f"))) float fma_zmm(int64_t iters, int threads) {
  float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    }
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS; ++i) s = _mm512_add_ps(s, acc[i]);
    total += _mm512_reduce_add_ps(s);
  }
  return total;
}
