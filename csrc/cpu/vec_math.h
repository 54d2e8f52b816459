// Elementwise math written once for every vector width: a kernel instantiates these templates with the
// traits struct of its width's intrinsics (Ymm below for AVX2, Zmm for AVX-512), so each variant runs
// the same operations lane by lane and gives the same bits. Users: the attention's online softmax
// (attention_kernels.h, attention_avx512.cpp) and silu_and_mul. A file compiled for a wider ISA by
// `#pragma GCC target` includes this after the pragma (the templates have no target of their own).
#pragma once

#include <cstdint>
#include <initializer_list>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace minisched::cpu::vec {

// expf, Cephes-style: x = n ln2 + r (ln 2 in two parts), exp(r) by a degree-5 polynomial, 2^n through the
// exponent field; relative error ~2e-7. Exactly 0 for x < -87.3 (so -inf gives 0), NaN for NaN.
// attention_kernels.h's scalar exp_approx is the same arithmetic for one lane.
template <class V>
inline typename V::F exp(typename V::F x) {
  const auto lo = V::set1(-87.3f);
  const auto xc = V::min(V::max(x, lo), V::set1(88.3f));
  const auto fx = V::floor(V::fmadd(xc, V::set1(1.44269504088896341f), V::set1(0.5f)));
  auto r = V::fnmadd(fx, V::set1(0.693359375f), xc);
  r = V::fmadd(fx, V::set1(2.12194440e-4f), r);
  auto y = V::set1(1.9875691500e-4f);
  for (const float p : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = V::fmadd(y, r, V::set1(p));
  y = V::fmadd(y, V::mul(r, r), V::add(r, V::set1(1.f)));
  const auto res = V::blend(V::lt(x, lo), V::set1(0.f), V::mul(y, V::pow2(fx)));
  return V::blend(V::unordered(x, x), x, res);
}

// silu(g) * u = g / (1 + e) * u with e = exp(-g) for g >= 0, and g e / (1 + e) * u with e = exp(g) for
// g < 0: e stays in (0, 1], so a large negative g gives ~0, not g / exp(88) (and -inf gives NaN, as
// torch's silu does).
template <class V>
inline typename V::F silu_mul(typename V::F g, typename V::F u) {
  const auto e = exp<V>(V::neg_abs(g));
  const auto num = V::blend(V::lt(g, V::set1(0.f)), V::mul(g, e), g);
  return V::mul(V::div(num, V::add(e, V::set1(1.f))), u);
}

#if defined(__AVX2__) && defined(__FMA__)
// The 8-lane (AVX2 + FMA) intrinsics.
struct Ymm {
  using F = __m256;
  using M = __m256;  // lane masks
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F floor(F a) { return _mm256_floor_ps(a); }
  static F neg_abs(F a) { return _mm256_or_ps(a, _mm256_set1_ps(-0.f)); }
  static F pow2(F n) {  // 2^n for integral n in [-127, 128)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static M lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M unordered(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
  static F blend(M m, F if_set, F if_clear) { return _mm256_blendv_ps(if_clear, if_set, m); }
};
#endif

#if defined(MINISCHED_VEC_ZMM)
// The 16-lane (AVX-512) intrinsics: only for a file that defines MINISCHED_VEC_ZMM and includes this inside
// its AVX-512 `#pragma GCC target` region (the *_avx512.cpp variants; the pragma does not define __AVX512F__).
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
#endif

}  // namespace minisched::cpu::vec
