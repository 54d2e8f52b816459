// The AVX-512 variants of the CPU attention loop's two block products (attention_kernels.h has the
// AVX2 ones; attention_cpu.h the loop): scores of up to 4 query rows x 4 keys as 16 zmm dot products
// reduced together by one transpose-and-add tree, and the probability-weighted sum of the values with
// 4 rows x 64 columns of accumulators (16 zmm); and, for tiles of 16 rows or more (prefill), a whole
// online-softmax step on lane groups of 16 rows (attn_block_lanes). For head_dim % 16 == 0 (the loop falls
// back to AVX2 otherwise). Compiled for AVX-512 after every header but vec_math.h (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512_undefined_ps (PR 105593)

#define MINISCHED_VEC_ZMM 1  // vec::Zmm: this region is compiled for AVX-512
#include "cpu/vec_math.h"

namespace minisched::cpu::avx512 {
namespace {

// r[i] = sum of a[i]'s 16 lanes, for 16 vectors.
inline __m512 reduce16(__m512 (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] =
        _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // c[i], 128-bit lane L, element j: lane L's part of the sum of a[4 i + j]
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

// S[r][j .. j + 3] = <q_r, k_{j + u}> for R (1..4) rows and 4 keys (lanes of absent rows are zero).
template <int R>
inline void scores_rx4(const float* q, int64_t d, const float* const* k, float* S, int64_t lds) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    __m512 kv[4];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) kv[u] = _mm512_loadu_ps(k[u] + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * d + i);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) a[4 * r + u] = _mm512_fmadd_ps(qv, kv[u], a[4 * r + u]);
    }
  }
  const __m512 s = reduce16(a);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm_storeu_ps(S + r * lds, _mm512_extractf32x4_ps(s, r));
}

inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// acc_r[off : off + 16 NV] += sum_j P[r][j] v_j[off : off + 16 NV] for R (1..4) rows; P[r][j] is at
// P[r * prs + j * pjs] (row-major scores, or a lane group's key-major probabilities).
template <int R, int NV>
inline void pv_tile(float* acc, int64_t d, const float* P, int64_t prs, int64_t pjs, const float* const* v, int64_t n,
                    int64_t off) {
  __m512 c[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) c[r][u] = _mm512_loadu_ps(acc + r * d + off + 16 * u);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[NV];
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) vv[u] = _mm512_loadu_ps(v[j] + off + 16 * u);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(P[r * prs + j * pjs]);
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) c[r][u] = _mm512_fmadd_ps(b, vv[u], c[r][u]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc + r * d + off + 16 * u, c[r][u]);
}

template <int R>
inline void pv_rows(float* acc, int64_t d, const float* P, int64_t prs, int64_t pjs, const float* const* v, int64_t n) {
  int64_t off = 0;
  for (; off + 64 <= d; off += 64) pv_tile<R, 4>(acc, d, P, prs, pjs, v, n, off);
  for (; off < d; off += 16) pv_tile<R, 1>(acc, d, P, prs, pjs, v, n, off);
}

// R rows of accumulators from row r of P (strides prs, pjs), R = rows - r clamped to 1..4.
inline void pv_rest(float* acc, int64_t rows, int64_t d, const float* P, int64_t prs, int64_t pjs,
                    const float* const* v, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows<4>(acc + r * d, d, P + r * prs, prs, pjs, v, n);
  switch (rows - r) {
    case 3:
      pv_rows<3>(acc + r * d, d, P + r * prs, prs, pjs, v, n);
      break;
    case 2:
      pv_rows<2>(acc + r * d, d, P + r * prs, prs, pjs, v, n);
      break;
    case 1:
      pv_rows<1>(acc + r * d, d, P + r * prs, prs, pjs, v, n);
      break;
    default:
      break;
  }
}

}  // namespace

void attn_block_scores(const float* q, int64_t rows, int64_t d, const float* const* k, int64_t n, float* S,
                       int64_t lds) {
  const int64_t n4 = n / 4 * 4;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    for (int64_t j = 0; j < n4; j += 4) scores_rx4<4>(q + r * d, d, k + j, S + r * lds + j, lds);
  for (int64_t j = 0; j < n4 && r < rows; j += 4) {
    switch (rows - r) {
      case 3:
        scores_rx4<3>(q + r * d, d, k + j, S + r * lds + j, lds);
        break;
      case 2:
        scores_rx4<2>(q + r * d, d, k + j, S + r * lds + j, lds);
        break;
      default:
        scores_rx4<1>(q + r * d, d, k + j, S + r * lds + j, lds);
        break;
    }
  }
  for (int64_t rr = 0; rr < rows; ++rr)
    for (int64_t j = n4; j < n; ++j) S[rr * lds + j] = dot(q + rr * d, k[j], d);
}

void attn_block_accumulate(float* acc, int64_t rows, int64_t d, const float* P, int64_t ldp, const float* const* v,
                           int64_t n) {
  pv_rest(acc, rows, d, P, ldp, 1, v, n);
}

void attn_block_lanes(const float* qt, int64_t d, const float* const* k, const float* const* v, int64_t n, int64_t j0,
                      const int32_t* lim, int64_t rows, float* m, float* l, float* acc, float* pt) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const __m512i limv = _mm512_loadu_si512(lim);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  // -- scores, key-major: pt[j] = the 16 rows' <q_r, k_j>, -inf where row r must not see key j0 + j --
  __m512 mx = neg_inf;
  for (int64_t j = 0; j < n; j += 8) {
    const float* kk[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) kk[u] = k[std::min<int64_t>(j + u, n - 1)];
    __m512 a[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      const __m512 qv = _mm512_loadu_ps(qt + i * 16);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kk[u][i]), a[u]);
    }
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      if (j + u >= n) break;
      const __mmask16 sees =
          _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j0 + j + u)), limv, _MM_CMPINT_LE);
      const __m512 sc = _mm512_mask_mov_ps(neg_inf, sees, a[u]);
      _mm512_storeu_ps(pt + (j + u) * 16, sc);
      mx = _mm512_max_ps(mx, sc);
    }
  }
  // -- online softmax across the lanes: every row's max, probabilities and sum at once --
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  // a row that has seen no key yet keeps m = -inf: subtract 0 there (exp(-inf) = 0, no NaN)
  const __m512 m_sub = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 e = vec::exp<vec::Zmm>(_mm512_sub_ps(_mm512_loadu_ps(pt + j * 16), m_sub));
    _mm512_storeu_ps(pt + j * 16, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 corr = vec::exp<vec::Zmm>(_mm512_sub_ps(m_old, m_sub));  // 0 for a row's first keys
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), corr, sum));
  _mm512_storeu_ps(m, m_new);
  alignas(64) float c[16];
  _mm512_store_ps(c, corr);
  for (int64_t r = 0; r < rows; ++r) {
    if (c[r] == 1.f) continue;
    const __m512 cr = _mm512_set1_ps(c[r]);
    for (int64_t i = 0; i < d; i += 16)
      _mm512_storeu_ps(acc + r * d + i, _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + i), cr));
  }
  // -- acc_r += sum_j p_rj v_j --
  pv_rest(acc, rows, d, pt, 1, 16, v, n);
}

}  // namespace minisched::cpu::avx512

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx512::attn_block_scores(const float*, int64_t, int64_t, const float* const*, int64_t, float*,
                                               int64_t) {
  __builtin_trap();
}
void minisched::cpu::avx512::attn_block_accumulate(float*, int64_t, int64_t, const float*, int64_t, const float* const*,
                                                   int64_t) {
  __builtin_trap();
}
void minisched::cpu::avx512::attn_block_lanes(const float*, int64_t, const float* const*, const float* const*, int64_t,
                                              int64_t, const int32_t*, int64_t, float*, float*, float*, float*) {
  __builtin_trap();
}
#endif
