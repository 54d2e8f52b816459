// The AVX-512 variant of silu_and_mul's row loop (silu_and_mul.cpp has the AVX2 one): vec_math.h's
// silu_mul on 16 lanes, masked loads for the tail; the same bits as the AVX2 variant. Compiled for
// AVX-512 after every header but vec_math.h (cpu_isa.h).
#include <immintrin.h>

#include <cstdint>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512_undefined_ps (PR 105593)

#define MINISCHED_VEC_ZMM 1  // vec::Zmm: this region is compiled for AVX-512
#include "cpu/vec_math.h"

namespace minisched::cpu::avx512 {
void silu_and_mul_rows(const float* x, float* out, int64_t D, int64_t m0, int64_t m1) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (D % 16)) - 1u);
  const int64_t body = D / 16 * 16;
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = x + m * 2 * D;
    const float* u = g + D;
    float* o = out + m * D;
    for (int64_t j = 0; j < body; j += 16)
      _mm512_storeu_ps(o + j, vec::silu_mul<vec::Zmm>(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
    if (tail)
      _mm512_mask_storeu_ps(
          o + body, tail,
          vec::silu_mul<vec::Zmm>(_mm512_maskz_loadu_ps(tail, g + body), _mm512_maskz_loadu_ps(tail, u + body)));
  }
}

}  // namespace minisched::cpu::avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::silu_and_mul_rows(const float*, float*, int64_t, int64_t, int64_t) { __builtin_trap(); }
#endif
