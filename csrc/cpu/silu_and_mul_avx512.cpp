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

#include "cpu/vec_math.h"

namespace minisched::cpu::avx512 {
namespace {

// The 16-lane intrinsics vec_math.h's templates are written in.
struct Zmm {
  using F = __m512;
  using M = __mmask16;
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F neg_abs(F a) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static F pow2(F n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M unordered(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  static F blend(M m, F if_set, F if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
};

}  // namespace

void silu_and_mul_rows(const float* x, float* out, int64_t D, int64_t m0, int64_t m1) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (D % 16)) - 1u);
  const int64_t body = D / 16 * 16;
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = x + m * 2 * D;
    const float* u = g + D;
    float* o = out + m * D;
    for (int64_t j = 0; j < body; j += 16)
      _mm512_storeu_ps(o + j, vec::silu_mul<Zmm>(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
    if (tail)
      _mm512_mask_storeu_ps(
          o + body, tail,
          vec::silu_mul<Zmm>(_mm512_maskz_loadu_ps(tail, g + body), _mm512_maskz_loadu_ps(tail, u + body)));
  }
}

}  // namespace minisched::cpu::avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::silu_and_mul_rows(const float*, float*, int64_t, int64_t, int64_t) { __builtin_trap(); }
#endif
