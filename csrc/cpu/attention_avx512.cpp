// The AVX-512 variants of the CPU attention loop's two block products (attention_kernels.h has the
// AVX2 ones; attention_cpu.h the loop): scores of up to 4 query rows x 4 keys as 16 zmm dot products
// reduced together by one transpose-and-add tree, and the probability-weighted sum of the values with
// 4 rows x 64 columns of accumulators (16 zmm). For head_dim % 16 == 0 (the loop falls back to AVX2
// otherwise). Compiled for AVX-512 after every header (cpu_isa.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on _mm512_undefined_ps (PR 105593)

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

// acc_r[off : off + 16 NV] += sum_j P[r][j] v_j[off : off + 16 NV] for R (1..4) rows.
template <int R, int NV>
inline void pv_tile(float* acc, int64_t d, const float* P, int64_t ldp, const float* const* v, int64_t n, int64_t off) {
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
      const __m512 b = _mm512_set1_ps(P[r * ldp + j]);
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
inline void pv_rows(float* acc, int64_t d, const float* P, int64_t ldp, const float* const* v, int64_t n) {
  int64_t off = 0;
  for (; off + 64 <= d; off += 64) pv_tile<R, 4>(acc, d, P, ldp, v, n, off);
  for (; off < d; off += 16) pv_tile<R, 1>(acc, d, P, ldp, v, n, off);
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
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows<4>(acc + r * d, d, P + r * ldp, ldp, v, n);
  switch (rows - r) {
    case 3:
      pv_rows<3>(acc + r * d, d, P + r * ldp, ldp, v, n);
      break;
    case 2:
      pv_rows<2>(acc + r * d, d, P + r * ldp, ldp, v, n);
      break;
    case 1:
      pv_rows<1>(acc + r * d, d, P + r * ldp, ldp, v, n);
      break;
    default:
      break;
  }
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
#endif
