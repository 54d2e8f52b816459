// The AVX-512 variant of rms_norm's row loop (rms_norm.cpp has the AVX2 one): 16-wide partial sums
// of squares, masked loads for the tail. Compiled for AVX-512 after every header (cpu_isa.h).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512_undefined_ps (PR 105593)

namespace minisched::cpu::avx512 {

void rms_norm_rows(float* x, const float* delta, const float* w, float eps, float* out, int64_t D, int64_t m0,
                   int64_t m1) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (D % 16)) - 1u);
  const int64_t body = D / 16 * 16;
  for (int64_t m = m0; m < m1; ++m) {
    float* xr = x + m * D;
    const float* dr = delta == nullptr ? nullptr : delta + m * D;
    float* o = out + m * D;
    __m512 ss0 = _mm512_setzero_ps(), ss1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < body; k += 16) {
      __m512 v = _mm512_loadu_ps(xr + k);
      if (dr != nullptr) {
        v = _mm512_add_ps(v, _mm512_loadu_ps(dr + k));
        _mm512_storeu_ps(xr + k, v);
      }
      if ((k / 16) % 2)
        ss1 = _mm512_fmadd_ps(v, v, ss1);
      else
        ss0 = _mm512_fmadd_ps(v, v, ss0);
    }
    if (tail) {
      __m512 v = _mm512_maskz_loadu_ps(tail, xr + k);
      if (dr != nullptr) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(tail, dr + k));
        _mm512_mask_storeu_ps(xr + k, tail, v);
      }
      ss0 = _mm512_fmadd_ps(v, v, ss0);
    }
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(ss0, ss1));
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(sum / static_cast<float>(D) + eps));
    for (k = 0; k < body; k += 16)
      _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_loadu_ps(w + k), _mm512_mul_ps(_mm512_loadu_ps(xr + k), inv)));
    if (tail)
      _mm512_mask_storeu_ps(
          o + k, tail,
          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, w + k), _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + k), inv)));
  }
}

}  // namespace minisched::cpu::avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::rms_norm_rows(float*, const float*, const float*, float, float*, int64_t, int64_t,
                                           int64_t) {
  __builtin_trap();
}
#endif
