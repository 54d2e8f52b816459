// The one paged attention kernel behind paged_decode_attention, paged_prefill_attention and
// shared_prefix_attention: FlashAttention-2 style tiles on mma.sync m16n8k16 (bf16/fp16 in,
// fp32 accumulate), online softmax in the log2 domain, K/V pages gathered by the page table
// into shared memory with 16-byte cp.async (two stages, attention_loader.cuh), split-KV with a
// merge pass (attention_splits.cuh), ragged rows through a device tile map (attention_tile_map.cuh).
//
// Rows of a query tile are (query token, q head in the kv head's GQA group) pairs, so one CTA
// reads a request's K/V pages for one kv head ONCE for the whole group (decode: all `group`
// heads of the one query; prefill: rows_tile / group tokens x group heads; shared prefix: the
// group's requests x heads). A CTA is ROW_WARPS x KV_WARPS warps: each warp owns RF m16 row
// fragments (16 x RF rows) and a 64 / KV_WARPS-token slice of every KV tile (split-K inside the
// CTA); the KV warps of a row tile keep their own online-softmax state and merge it through
// shared memory at the end. Prefill and shared prefix: 4 x 1 warps x 32 rows (128-row tiles: every
// K/V fragment loaded from shared memory feeds both row fragments' mma). Decode (a handful of rows
// per CTA): 1 x 4 or 2 x 2 with 16 rows per warp, so that 4 warps share each tile's shared memory
// and 12 warps are resident per SM, not 3; 4 x 1 x 16 rows for GQA > 32.
//
// Instantiations: {bf16, fp16} x head_dim {64, 128} x the 4 CTA shapes.
#include "cuda/attention_loader.cuh"
#include "cuda/attention_splits.cuh"
#include "cuda/attention_tile_map.cuh"
#include "cuda/attention_utils.cuh"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace minisched::cuda {
namespace {

constexpr int kStages = 2;  // cp.async pipeline depth
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }

template <int D>
constexpr int pitch() {  // smem row pitch in elements: +16 bytes so ldmatrix rows hit distinct banks
  return D + 8;
}

// Q tile (rows_tile rows) + K and V stages of kBlockN rows; the KV warps' merge reuses the K/V
// stages once the last tile is consumed (merge_bytes).
template <int D>
constexpr size_t smem_bytes(int rows_tile) {
  return size_t(rows_tile + 2 * kStages * kBlockN) * pitch<D>() * 2;
}
template <int D>
constexpr int merge_pitch() {  // fp32 row pitch of the merge buffer: +8 floats, conflict-free float2 stores
  return D + 8;
}
template <int D>
constexpr size_t merge_bytes(int rows_tile, int kv_warps) {  // m and l of every warp's rows, o of kv warps >= 1
  return size_t(2 * kv_warps * rows_tile + (kv_warps - 1) * rows_tile * merge_pitch<D>()) * 4;
}

template <typename T, int D, int ROW_WARPS, int KV_WARPS, int RF>
// Min CTAs per SM in the launch bounds only for the D 64 prefill CTA (3: 168 registers, 3 x 55 KB of
// shared memory; without it ptxas takes 205 registers = 2 CTAs). Elsewhere none: tried (3 for the
// 1 x 4 decode CTA, what shared memory allows), ptxas gave the same CTAs per SM and spent more on
// the 4 x 1 CTA at any value, even 1 (204 instead of 173). tests/ops/test_cuda_build.py checks the
// resident warps per SM of the decode and prefill CTAs.
__global__ void __launch_bounds__(ROW_WARPS * KV_WARPS * 32, (D == 64 && RF == 2) ? 3 : 0)
    paged_attention_kernel(const AttentionParams p) {
  constexpr int WARPS = ROW_WARPS * KV_WARPS;
  constexpr int SP = pitch<D>();
  constexpr int CH = D / 8;               // 16-byte chunks per row
  constexpr int KS = D / 16;              // k-steps of QK^T
  constexpr int NW = kBlockN / KV_WARPS;  // KV tokens of each tile one warp computes on (its sub-tile)
  constexpr int NT = NW / 8;              // n8 tiles of the warp's S
  constexpr int DT = D / 8;               // n8 tiles of O
  constexpr int WR = 16 * RF;             // rows per warp: RF m16 row fragments
  constexpr int NR = 2 * RF;              // rows per thread: fragment f, half h -> warp row f * 16 + h * 8 + lane / 4
  // Q fragments stay in registers for the whole loop with one row fragment (KS * 4 registers); the
  // 32-row warp reloads them from shared memory per k-step (RF ldmatrix.x4 per k-step, NOTES.md
  // "Prefill kernel (mma.sync)"): at D 128 o (128) + S (64) leave no room for 64 more, at D 64
  // they would cost 205 -> 235 registers, i.e. 2 CTAs per SM instead of 3.
  constexpr bool Q_REGS = RF == 1;
  static_assert(NW % 16 == 0, "P V takes 16 tokens per mma k-step");
  static_assert(RF == 1 || KV_WARPS == 1, "several row fragments per warp: prefill's 4 x 1 CTA only");
  static_assert(
      KV_WARPS == 1 || merge_bytes<D>(16 * RF * ROW_WARPS, KV_WARPS) <= 2 * kStages * kBlockN * SP * sizeof(T),
      "the KV warps' merge must fit in the K/V stages");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  constexpr int nthreads = WARPS * 32;
  constexpr int rows_tile = WR * ROW_WARPS;
  T* sK = sQ + rows_tile * SP;
  T* sV = sK + kStages * kBlockN * SP;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // the warp's KV sub-tile and rows (kw is 0 at compile time for KV_WARPS = 1: no extra registers)
  const int kw = KV_WARPS == 1 ? 0 : warp / ROW_WARPS, rw = warp - kw * ROW_WARPS;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int g = p.group;

  // -- which request and which tile of its rows -------------------------------------------------
  const TileLoc loc = locate_tile(p, blockIdx.x);
  if (!loc.ok) return;
  const int b = loc.b, tile = loc.tile, q_start = loc.q_start, qo_len = loc.qo_len;
  const int rows_total = qo_len * g;
  const int row_beg = tile * rows_tile;
  const int rows_valid = min(rows_tile, rows_total - row_beg);

  // -- request validity (never dereference a bad page table) -------------------------------------
  const int kv_beg = p.kv_indptr[b], kv_endp = p.kv_indptr[b + 1], last = p.kv_last_page_len[b];
  // no pages (kv_beg == kv_endp) is an empty KV range: kv_len 0, so o = 0 and lse = -inf
  bool bad = !(kv_beg >= 0 && kv_beg <= kv_endp && kv_endp <= p.nnz && last >= 1 && last <= p.page_size);
  const long long kv_len_ll = kv_endp > kv_beg ? (long long)(kv_endp - kv_beg - 1) * p.page_size + last : 0;
  bad = bad || kv_len_ll > 0x7fffffffLL || (p.causal && kv_len_ll < qo_len);  // causal rows need >= 1 key
  const int kv_len = bad ? 0 : int(kv_len_ll);

  const bool split_mode = p.num_splits > 1;
  T* out = reinterpret_cast<T*>(p.out);

  // -- KV range of this split (tile aligned), cut by the causal limit of the tile's last row -----
  int chunk = (kv_len + p.num_splits - 1) / p.num_splits;
  chunk = (chunk + kBlockN - 1) / kBlockN * kBlockN;
  const int s_beg = split * chunk;
  int s_end = min(kv_len, s_beg + chunk);
  if (p.causal && rows_valid > 0) {
    const int qi_last = (row_beg + rows_valid - 1) / g;
    s_end = min(s_end, kv_len - qo_len + qi_last + 1);
  }
  const int n_tiles = (bad || s_end <= s_beg) ? 0 : (s_end - s_beg + kBlockN - 1) / kBlockN;

  // -- Q tile and the first K/V tile -------------------------------------------------------------
  const T* qg = reinterpret_cast<const T*>(p.q);
  for (int idx = tid; idx < rows_tile * CH; idx += nthreads) {
    const int r = idx / CH, c = idx % CH;
    const int pr = row_beg + r;
    const bool valid = !bad && r < rows_valid;
    const T* src = qg;
    if (valid) src = qg + ((long long)(q_start + pr / g) * p.num_heads + kvh * g + pr % g) * D + c * 8;
    cp_async_16(sQ + r * SP + c * 8, src, valid);
  }
  KvLoader<T, D, WARPS> kv(p, lane, warp, kvh, kv_beg, s_beg, s_end);
  if (n_tiles > 0) {
    kv.fetch_idx(0);
    kv.make_bases(0);
    kv.copy_kv<SP>(sK, sV, 0);
    if (n_tiles > 1) kv.fetch_idx(1);
  }
  cp_async_commit();

  // -- per-thread state: rows f * 16 + lane/4 (+ 8) of the warp's WR, i = 2 f + h -----------------
  const int wrow0 = rw * WR + (lane >> 2);
  auto wrow = [&](int i) { return wrow0 + (i >> 1) * 16 + (i & 1) * 8; };
  // last KV position thread row i may see (causal); else kv_len - 1. One 16-row fragment keeps its
  // two rows' limits in registers; the 32-row warp (255 registers at D 128) keeps the first only
  // (need_mask) and recomputes the others in boundary tiles.
  auto limit_of = [&](int i) { return p.causal ? kv_len - qo_len + (row_beg + wrow(i)) / g : kv_len - 1; };
  int limit[RF == 1 ? 2 : 1];
  limit[0] = limit_of(0);
  if constexpr (RF == 1) limit[1] = limit_of(1);
  auto limit_at = [&](int i) { return RF == 1 ? limit[RF == 1 ? i : 0] : limit_of(i); };
  float o[RF][DT][4];
#pragma unroll
  for (int f = 0; f < RF; ++f)
#pragma unroll
    for (int j = 0; j < DT; ++j) o[f][j][0] = o[f][j][1] = o[f][j][2] = o[f][j][3] = 0.f;
  float m[NR], l[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) m[i] = kNegInf, l[i] = 0.f;
  uint32_t qa[Q_REGS ? RF : 1][Q_REGS ? KS : 1][4];
  // row fragment f's A fragment for k-step ks: lanes 0-15 rows 0-15 columns 0-7, lanes 16-31 columns 8-15
  auto ld_q = [&](uint32_t (&r)[4], int f, int ks) {
    ldmatrix_x4(r, sQ + (rw * WR + f * 16 + (lane & 15)) * SP + ks * 16 + (lane >> 4) * 8);
  };

  // One barrier per tile: after it, tile t (and at t = 0 the Q tile) is in shared memory for every
  // thread and every warp is done with tile t - 1, whose stage ((t + 1) & 1) tile t + 1 then fills
  // while tile t is computed.
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < n_tiles) {  // tile t+1's pages were fetched during tile t-1: resolve, copy, fetch t+2's
      kv.make_bases(t + 1);
      kv.copy_kv<SP>(sK, sV, (t + 1) & 1);
      if (t + 2 < n_tiles) kv.fetch_idx(t + 2);
    }
    cp_async_commit();
    if constexpr (Q_REGS) {
      if (t == 0) {
#pragma unroll
        for (int f = 0; f < RF; ++f)
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) ld_q(qa[f][ks], f, ks);
      }
    }
    // this warp's sub-tile: tile rows kw * NW .. kw * NW + NW - 1
    const T* k_s = sK + ((t & 1) * kBlockN + kw * NW) * SP;
    const T* v_s = sV + ((t & 1) * kBlockN + kw * NW) * SP;
    const int tok0 = s_beg + t * kBlockN + kw * NW;

    // -- S = Q K^T: each K fragment feeds the RF row fragments ------------------------------------
    float s[RF][NT][4];
#pragma unroll
    for (int f = 0; f < RF; ++f)
#pragma unroll
      for (int j = 0; j < NT; ++j) s[f][j][0] = s[f][j][1] = s[f][j][2] = s[f][j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t qs[Q_REGS ? 1 : RF][4];
      if constexpr (!Q_REGS) {
#pragma unroll
        for (int f = 0; f < RF; ++f) ld_q(qs[f], f, ks);
      }
#pragma unroll
      for (int nb = 0; nb < NT / 2; ++nb) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_s + (nb * 16 + (lane & 7) + (lane >> 4) * 8) * SP + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int f = 0; f < RF; ++f) {
          const uint32_t (&a)[4] = Q_REGS ? qa[Q_REGS ? f : 0][Q_REGS ? ks : 0] : qs[Q_REGS ? 0 : f];
          mma_16816<T>(s[f][2 * nb], a, kb[0], kb[1]);
          mma_16816<T>(s[f][2 * nb + 1], a, kb[2], kb[3]);
        }
      }
    }
    // -- scale + mask (limit[0] is the thread's smallest limit: limits grow with the row) ------------
    const bool need_mask = tok0 + NW > s_end || (p.causal && tok0 + NW - 1 > limit[0]);
    if constexpr (RF == 1) {  // one fragment (decode, GQA > 32): scale and mask in one pass, limits in registers
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[0][j][e] * p.scale_log2;
          if (need_mask) {
            const int tok = tok0 + j * 8 + (lane & 3) * 2 + (e & 1);
            if (tok >= s_end || tok > limit_at(e >> 1)) v = kNegInf;
          }
          s[0][j][e] = v;
        }
    } else {  // two fragments: scale, then (boundary tiles) mask row by row, recomputing each row's limit
#pragma unroll
      for (int f = 0; f < RF; ++f)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[f][j][e] *= p.scale_log2;
      if (need_mask) {
#pragma unroll
        for (int i = 0; i < NR; ++i) {
          const int lim = min(s_end - 1, limit_at(i)), f = i >> 1, h = (i & 1) * 2;
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int tok = tok0 + j * 8 + (lane & 3) * 2 + e;
              if (tok > lim) s[f][j][h + e] = kNegInf;
            }
        }
      }
    }
    // -- online softmax: thread row i is S elements s[i / 2][.][2 (i % 2) + {0, 1}] ---------------
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int f = i >> 1, h = (i & 1) * 2;
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[f][j][h], s[f][j][h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i], mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      const float alpha = fast_exp2(m[i] - m_use);
      m[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        s[f][j][h] = fast_exp2(s[f][j][h] - m_use);
        s[f][j][h + 1] = fast_exp2(s[f][j][h + 1] - m_use);
        sum += s[f][j][h] + s[f][j][h + 1];
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        o[f][j][h] *= alpha;
        o[f][j][h + 1] *= alpha;
      }
    }
    // -- O += P V: each V fragment feeds the RF row fragments --------------------------------------
#pragma unroll
    for (int kb = 0; kb < NT / 2; ++kb) {
      uint32_t pa[RF][4];
#pragma unroll
      for (int f = 0; f < RF; ++f) {
        pa[f][0] = pack2<T>(s[f][2 * kb][0], s[f][2 * kb][1]);
        pa[f][1] = pack2<T>(s[f][2 * kb][2], s[f][2 * kb][3]);
        pa[f][2] = pack2<T>(s[f][2 * kb + 1][0], s[f][2 * kb + 1][1]);
        pa[f][3] = pack2<T>(s[f][2 * kb + 1][2], s[f][2 * kb + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_s + (kb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SP + dp * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int f = 0; f < RF; ++f) {
          mma_16816<T>(o[f][2 * dp], pa[f], vb[0], vb[1]);
          mma_16816<T>(o[f][2 * dp + 1], pa[f], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad || kv.bad_page);  // also: every warp is done with the K/V stages

#pragma unroll
  for (int i = 0; i < NR; ++i) {  // row sums over the quad (m is already row-wide)
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const int c2 = (lane & 3) * 2;  // the thread's column pair in each n8 tile of O

  // -- merge the KV warps (split-K inside the CTA; RF = 1) -----------------------------------------
  // Warp (rw, kw) holds m (log2 domain), l and the unnormalized o of rows rw * 16.. over its own
  // sub-tiles. Every warp rescales to the row maximum over the KV warps, M, and computes the common
  // L = sum_k l_k 2^(m_k - M); warps kw >= 1 hand their o to warp kw = 0 through shared memory
  // (the K/V stages, free now), which adds them up and runs the epilogue. A warp that saw no key
  // (m = -inf) contributes 2^-inf = 0; no key at all gives M = -inf, L = 0: out 0, lse -inf.
  if constexpr (KV_WARPS > 1) {
    constexpr int OP = merge_pitch<D>();
    float* s_m = reinterpret_cast<float*>(sK);  // [KV_WARPS][rows_tile]
    float* s_l = s_m + KV_WARPS * rows_tile;    // [KV_WARPS][rows_tile]
    float* s_o = s_l + KV_WARPS * rows_tile;    // [KV_WARPS - 1][rows_tile][OP]
    if ((lane & 3) == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s_m[kw * rows_tile + wrow0 + 8 * i] = m[i];
        s_l[kw * rows_tile + wrow0 + 8 * i] = l[i];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = wrow0 + 8 * i;
      float mx = kNegInf;
#pragma unroll
      for (int k = 0; k < KV_WARPS; ++k) mx = fmaxf(mx, s_m[k * rows_tile + r]);
      const float m_use = mx == kNegInf ? 0.f : mx;
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < KV_WARPS; ++k) sum += s_l[k * rows_tile + r] * fast_exp2(s_m[k * rows_tile + r] - m_use);
      const float f = fast_exp2(m[i] - m_use);
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        o[0][j][2 * i] *= f;
        o[0][j][2 * i + 1] *= f;
      }
      m[i] = mx;
      l[i] = sum;
    }
    if (kw > 0) {
      float* dst = s_o + ((kw - 1) * rows_tile + wrow0) * OP + c2;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < DT; ++j)
          *reinterpret_cast<float2*>(dst + 8 * i * OP + j * 8) = make_float2(o[0][j][2 * i], o[0][j][2 * i + 1]);
    }
    __syncthreads();
    if (kw > 0) return;  // the CTA's last barrier is behind us
#pragma unroll
    for (int k = 1; k < KV_WARPS; ++k) {
      const float* src = s_o + ((k - 1) * rows_tile + wrow0) * OP + c2;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < DT; ++j) {
          const float2 v = *reinterpret_cast<const float2*>(src + 8 * i * OP + j * 8);
          o[0][j][2 * i] += v.x;
          o[0][j][2 * i + 1] += v.y;
        }
    }
  }

  // -- epilogue (warps kw = 0): the thread's rows; row -> (query token, head) ---------------------
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int r = wrow(i), f = i >> 1, h = (i & 1) * 2;
    if (r >= rows_valid) continue;
    const int pr = row_beg + r;
    const long long rh = (long long)(q_start + pr / g) * p.num_heads + kvh * g + pr % g;  // (row, head)
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    float lse_v = l[i] > 0.f ? (m[i] + __log2f(l[i])) * kLn2 : kNegInf;
    if (bad) lse_v = nan_f();
    if (!split_mode) {
      T* dst = out + rh * D + c2;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        const float a = bad ? nan_f() : o[f][j][h] * inv, bb = bad ? nan_f() : o[f][j][h + 1] * inv;
        *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(a, bb);
      }
      if ((lane & 3) == 0 && p.lse != nullptr) p.lse[rh] = lse_v;
    } else {
      const long long prh = (long long)split * p.num_qo * p.num_heads + rh;
      float* dst = p.part_out + prh * D + c2;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        const float a = bad ? nan_f() : o[f][j][h] * inv, bb = bad ? nan_f() : o[f][j][h + 1] * inv;
        *reinterpret_cast<float2*>(dst + j * 8) = make_float2(a, bb);
      }
      if ((lane & 3) == 0) p.part_lse[prh] = lse_v;
    }
  }
}

// Once per kernel configuration (T, D, CTA shape) and device, not per call: opt in to the
// dynamic shared memory and query the occupancy (the cache is per template instantiation).
// Benign race: two first callers both compute the same value.
template <typename T, int D, int ROW_WARPS, int KV_WARPS, int RF>
cudaError_t kernel_setup(size_t smem, int* per_sm) {
  constexpr int kDevices = 64;
  static std::atomic<int> cache[kDevices];  // 0: not yet; else CTAs per SM + 1
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::atomic<int>* slot = dev >= 0 && dev < kDevices ? &cache[dev] : nullptr;
  if (slot != nullptr) {
    const int v = slot->load(std::memory_order_relaxed);
    if (v > 0) {
      *per_sm = v - 1;
      return cudaSuccess;
    }
  }
  auto kernel = paged_attention_kernel<T, D, ROW_WARPS, KV_WARPS, RF>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, ROW_WARPS * KV_WARPS * 32, smem);
  if (err != cudaSuccess) return err;
  if (slot != nullptr) slot->store(*per_sm + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

template <typename T, int D, int ROW_WARPS, int KV_WARPS, int RF>
cudaError_t launch_typed(AttentionParams p, int64_t est_kv_len, int num_sms, WorkspaceAllocator& alloc,
                         cudaStream_t stream) {
  const bool ragged = p.qo_indptr != nullptr;
  constexpr int warps = ROW_WARPS * KV_WARPS;
  constexpr int rows_tile = 16 * RF * ROW_WARPS;
  const size_t smem = smem_bytes<D>(rows_tile);
  auto kernel = paged_attention_kernel<T, D, ROW_WARPS, KV_WARPS, RF>;
  int per_sm = 0;
  cudaError_t err = kernel_setup<T, D, ROW_WARPS, KV_WARPS, RF>(smem, &per_sm);
  if (err != cudaSuccess) return err;

  p.tiles_per_request = ragged ? 0 : (p.group + rows_tile - 1) / rows_tile;
  const long long grid_x = grid_columns(p, rows_tile);  // ragged: ceil(num_qo * group / rows_tile) + batch
  long long est_ctas = ragged ? grid_x - p.batch : grid_x;
  if (grid_x == 0 || p.num_qo == 0) return cudaSuccess;
  est_ctas = std::max<long long>(1, est_ctas) * p.num_kv_heads;

  p.num_splits = choose_splits(est_ctas, std::max(1, per_sm) * num_sms, est_kv_len, kBlockN);

  if (ragged) {
    auto* offsets = static_cast<int32_t*>(alloc.allocate(sizeof(int32_t) * (p.batch + 1)));
    tile_map_kernel<<<1, 1024, 0, stream>>>(p.qo_indptr, p.batch, p.num_qo, p.group, rows_tile, offsets);
    p.tile_offsets = offsets;
  }
  if (p.num_splits > 1) {
    const size_t rows = size_t(p.num_qo) * p.num_heads;
    p.part_out = static_cast<float*>(alloc.allocate(sizeof(float) * p.num_splits * rows * D));
    p.part_lse = static_cast<float*>(alloc.allocate(sizeof(float) * p.num_splits * rows));
  }
  dim3 grid(unsigned(grid_x), unsigned(p.num_kv_heads), unsigned(p.num_splits));
  kernel<<<grid, warps * 32, smem, stream>>>(p);
  if (p.num_splits > 1) {
    merge_splits_kernel<T, D><<<dim3(unsigned(grid_x), unsigned(p.num_kv_heads)), 128, 0, stream>>>(p, rows_tile);
  }
  return cudaGetLastError();
}

// 4 warps per CTA, as row warps x KV warps x row fragments. Prefill / shared prefix (ragged rows):
// 4 x 1 x 2 (128-row tiles, 32 rows per warp) when the mean request has more than 64 rows (host-
// known: num_qo * group / batch), else 4 x 1 x 1 (64-row tiles: short extends would leave most of a
// 128-row tile empty, computing on zero rows). Decode: the fewest 16-row warps that hold the GQA
// group, the rest split each KV tile (1 x 4 for group <= 16, 2 x 2 for <= 32), else 4 x 1 x 1 and
// several 64-row tiles per request.
template <typename T, int D>
cudaError_t launch_typed(AttentionParams p, int64_t est_kv_len, int num_sms, WorkspaceAllocator& alloc,
                         cudaStream_t stream) {
  if (p.qo_indptr != nullptr) {
    if ((long long)p.num_qo * p.group > 64LL * p.batch)
      return launch_typed<T, D, 4, 1, 2>(p, est_kv_len, num_sms, alloc, stream);
    return launch_typed<T, D, 4, 1, 1>(p, est_kv_len, num_sms, alloc, stream);
  }
  if (p.group <= 16) return launch_typed<T, D, 1, 4, 1>(p, est_kv_len, num_sms, alloc, stream);
  if (p.group <= 32) return launch_typed<T, D, 2, 2, 1>(p, est_kv_len, num_sms, alloc, stream);
  return launch_typed<T, D, 4, 1, 1>(p, est_kv_len, num_sms, alloc, stream);
}

}  // namespace

cudaError_t launch_paged_attention(AttentionParams p, bool dtype_is_bf16, int head_dim, int64_t est_kv_len, int num_sms,
                                   WorkspaceAllocator& alloc, cudaStream_t stream) {
  p.num_splits = 1;
  p.part_out = nullptr;
  p.part_lse = nullptr;
  p.tile_offsets = nullptr;
  if (dtype_is_bf16) {
    if (head_dim == 64) return launch_typed<__nv_bfloat16, 64>(p, est_kv_len, num_sms, alloc, stream);
    if (head_dim == 128) return launch_typed<__nv_bfloat16, 128>(p, est_kv_len, num_sms, alloc, stream);
  } else {
    if (head_dim == 64) return launch_typed<__half, 64>(p, est_kv_len, num_sms, alloc, stream);
    if (head_dim == 128) return launch_typed<__half, 128>(p, est_kv_len, num_sms, alloc, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace minisched::cuda
