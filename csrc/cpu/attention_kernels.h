// Block math of the CPU attention loop (attention_cpu.h): scores of a tile of query rows
// against a block of up to kBlock keys, the online-softmax step of one row, and the
// probability-weighted sum of the block's values. Keys and values are addressed through an array
// of row pointers (fp32, D contiguous floats each), so a block may span several pages.
// With AVX2+FMA (x86-64-v3) the products are register-blocked over pairs of query rows
// (D % 8 == 0) and exp is evaluated 8 lanes at a time; otherwise plain loops do the same work.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/vec_math.h"

namespace minisched::cpu {

// expf (Cephes polynomial, relative error ~2e-7) written so that GCC vectorizes loops over it; vec::exp
// (vec_math.h) is the same arithmetic on vectors.
// Returns exactly 0 for x < -87.3 (so -inf gives 0) and NaN for NaN.
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float fx = std::floor(std::fma(xc, 1.44269504088896341f, 0.5f));
  float r = std::fma(fx, -0.693359375f, xc);
  r = std::fma(fx, 2.12194440e-4f, r);
  float y = 1.9875691500e-4f;
  y = std::fma(y, r, 1.3981999507e-3f);
  y = std::fma(y, r, 8.3334519073e-3f);
  y = std::fma(y, r, 4.1665795894e-2f);
  y = std::fma(y, r, 1.6666665459e-1f);
  y = std::fma(y, r, 5.0000001201e-1f);
  y = std::fma(y, r * r, r + 1.f);
  const float scale = std::bit_cast<float>((static_cast<int32_t>(fx) + 127) << 23);
  const float res = y * scale;
  return x != x ? x : (x < -87.3f ? 0.f : res);
}

namespace detail {

constexpr int64_t kBlock = 32;    // KV tokens per online-softmax step
constexpr int64_t kMaxRows = 32;  // query rows per tile (at least G)

// s[j] = <q, k_j> for j < n, four keys at a time (four independent FMA chains).
inline void scores(const float* __restrict q, const float* const* k, int64_t n, int64_t d, float* __restrict s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < d; ++i) {
      s0 = std::fma(q[i], k0[i], s0);
      s1 = std::fma(q[i], k1[i], s1);
      s2 = std::fma(q[i], k2[i], s2);
      s3 = std::fma(q[i], k3[i], s3);
    }
    s[j] = s0, s[j + 1] = s1, s[j + 2] = s2, s[j + 3] = s3;
  }
  for (; j < n; ++j) {
    const float* k0 = k[j];
    float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
    for (int64_t i = 0; i < d; ++i) s0 = std::fma(q[i], k0[i], s0);
    s[j] = s0;
  }
}

// acc += sum_j p[j] * v_j for j < n, four rows of V per pass over acc.
inline void accumulate(float* __restrict acc, const float* p, const float* const* v, int64_t n, int64_t d) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *v0 = v[j], *v1 = v[j + 1], *v2 = v[j + 2], *v3 = v[j + 3];
    const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i)
      acc[i] = std::fma(p3, v3[i], std::fma(p2, v2[i], std::fma(p1, v1[i], std::fma(p0, v0[i], acc[i]))));
  }
  for (; j < n; ++j) {
    const float* v0 = v[j];
    const float p0 = p[j];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p0, v0[i], acc[i]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 register-blocked versions of the two block products (D % 8 == 0): a pair of query rows
// shares every K/V load. Elsewhere the generic loops above do the same work row by row.

// [sum(a0), ..., sum(a7)]
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// S[r][j] = <q_r, k_j> for R (1 or 2) rows and 4 keys.
template <int R>
inline void scores_rx4(const float* q, int64_t d, const float* const* k, float* s0, float* s1) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < 4; ++u) a[r][u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv[R];
    for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q + r * d + i);
    for (int u = 0; u < 4; ++u) {
      const __m256 kv = _mm256_loadu_ps(k[u] + i);
      for (int r = 0; r < R; ++r) a[r][u] = _mm256_fmadd_ps(qv[r], kv, a[r][u]);
    }
  }
  const __m256 z = _mm256_setzero_ps();
  const __m256 sum = R == 2
                         ? hsum8(a[0][0], a[0][1], a[0][2], a[0][3], a[R - 1][0], a[R - 1][1], a[R - 1][2], a[R - 1][3])
                         : hsum8(a[0][0], a[0][1], a[0][2], a[0][3], z, z, z, z);
  _mm_storeu_ps(s0, _mm256_castps256_ps128(sum));
  if (R == 2) _mm_storeu_ps(s1, _mm256_extractf128_ps(sum, 1));
}

// acc_r[off : off + 8 NV] += sum_j p_r[j] v_j[off : off + 8 NV] for R (1 or 2) rows.
template <int R, int NV>
inline void pv_tile(float* acc, int64_t d, const float* p, const float* const* v, int64_t n, int64_t off) {
  __m256 c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) c[r][u] = _mm256_loadu_ps(acc + r * d + off + 8 * u);
  for (int64_t j = 0; j < n; ++j) {
    __m256 b[R];
    for (int r = 0; r < R; ++r) b[r] = _mm256_set1_ps(p[r * kBlock + j]);
    for (int u = 0; u < NV; ++u) {
      const __m256 vv = _mm256_loadu_ps(v[j] + off + 8 * u);
      for (int r = 0; r < R; ++r) c[r][u] = _mm256_fmadd_ps(b[r], vv, c[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + r * d + off + 8 * u, c[r][u]);
}

template <int R>
inline void pv_rows(float* acc, int64_t d, const float* p, const float* const* v, int64_t n) {
  int64_t off = 0;
  for (; off + 32 <= d; off += 32) pv_tile<R, 4>(acc, d, p, v, n, off);
  for (; off < d; off += 8) pv_tile<R, 1>(acc, d, p, v, n, off);
}

// exp_approx on 8 lanes (vec_math.h: the same template as silu_and_mul's, one copy for every width).
inline __m256 exp_approx8(__m256 x) { return vec::exp<vec::Ymm>(x); }
#endif

// One row's online-softmax step over a block: s [kBlock] holds the scores of keys 0..valid-1
// (1 <= valid <= n <= kBlock). Turns s into probabilities exp(s - m_new) (0 past valid, up to
// kBlock), returns m_new = max(m_old, max s) and adds the row sum to *sum.
inline float softmax_block(float* s, int64_t valid, float m_old, float* sum) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = valid; j < kBlock; ++j) s[j] = kNegInf;
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(kBlock % 8 == 0);
  __m256 mv = _mm256_set1_ps(m_old);
  for (int64_t j = 0; j < kBlock; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float m_new = _mm_cvtss_f32(m4);
  const __m256 mb = _mm256_set1_ps(m_new);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 8) {
    const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  a4 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
  a4 = _mm_add_ss(a4, _mm_shuffle_ps(a4, a4, 1));
  *sum += _mm_cvtss_f32(a4);
  return m_new;
#else
  float m_new = m_old;
  for (int64_t j = 0; j < valid; ++j) m_new = s[j] > m_new ? s[j] : m_new;
  float total = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float e = exp_approx(s[j] - m_new);
    s[j] = e;
    total += e;
  }
  *sum += total;
  return m_new;
#endif
}

// S[r][j] (row stride kBlock) = <q_r, k_j> for `rows` query rows q [rows, d] and n keys.
inline void block_scores(const float* q, int64_t rows, int64_t d, const float* const* k, int64_t n, float* S) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    const int64_t n4 = n / 4 * 4;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2)
      for (int64_t j = 0; j < n4; j += 4)
        scores_rx4<2>(q + r * d, d, k + j, S + r * kBlock + j, S + (r + 1) * kBlock + j);
    for (; r < rows; ++r)
      for (int64_t j = 0; j < n4; j += 4) scores_rx4<1>(q + r * d, d, k + j, S + r * kBlock + j, nullptr);
    if (n4 < n)
      for (r = 0; r < rows; ++r) scores(q + r * d, k + n4, n - n4, d, S + r * kBlock + n4);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) scores(q + r * d, k, n, d, S + r * kBlock);
}

// acc_r += sum_j P[r][j] v_j for `rows` accumulator rows [rows, d] and n values.
inline void block_accumulate(float* acc, int64_t rows, int64_t d, const float* P, const float* const* v, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) pv_rows<2>(acc + r * d, d, P + r * kBlock, v, n);
    if (r < rows) pv_rows<1>(acc + r * d, d, P + r * kBlock, v, n);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) accumulate(acc + r * d, P + r * kBlock, v, n, d);
}
}  // namespace detail

}  // namespace minisched::cpu
