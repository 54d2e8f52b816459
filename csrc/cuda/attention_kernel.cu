// The one paged attention kernel behind paged_decode_attention, paged_prefill_attention and
// shared_prefix_attention: FlashAttention-2 style tiles on mma.sync m16n8k16 (bf16/fp16 in,
// fp32 accumulate), online softmax in the log2 domain, K/V pages gathered by the page table
// into shared memory with 16-byte cp.async (two stages), split-KV with a merge pass.
//
// Rows of a query tile are (query token, q head in the kv head's GQA group) pairs, so one CTA
// reads a request's K/V pages for one kv head ONCE for the whole group (decode: all `group`
// heads of the one query; prefill: 16 * warps / group tokens x group heads; shared prefix:
// the group's requests x heads). A CTA is ROW_WARPS x KV_WARPS warps: each warp owns 16 rows and
// a 64 / KV_WARPS-token slice of every KV tile (split-K inside the CTA); the KV warps of a row tile
// keep their own online-softmax state and merge it through shared memory at the end. Prefill and
// shared prefix: 4 x 1 (64 rows). Decode (a handful of rows per CTA): 1 x 4 or 2 x 2, so that
// 4 warps share each tile's shared memory and 12 warps are resident per SM, not 3.
//
// Instantiations: {bf16, fp16} x head_dim {64, 128}.
#include "cuda/attention_utils.cuh"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace minisched::cuda {
namespace {

constexpr int kBlockN = 64;   // KV tokens per tile
constexpr int kStages = 2;    // cp.async pipeline depth
constexpr int kMaxRowWarps = 4;  // 16 query rows per warp: 64-row tiles for prefill
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }

template <int D>
constexpr int pitch() {  // smem row pitch in elements: +16 bytes so ldmatrix rows hit distinct banks
  return D + 8;
}

// Q tile (16 rows per row warp) + K and V stages of kBlockN rows; the KV warps' merge reuses the
// K/V stages once the last tile is consumed (merge_bytes).
template <int D>
constexpr size_t smem_bytes(int row_warps) {
  return size_t(16 * row_warps + 2 * kStages * kBlockN) * pitch<D>() * 2;
}
template <int D>
constexpr int merge_pitch() {  // fp32 row pitch of the merge buffer: +8 floats, conflict-free float2 stores
  return D + 8;
}
template <int D>
constexpr size_t merge_bytes(int row_warps, int kv_warps) {  // m and l of every warp's rows, o of kv warps >= 1
  return size_t(2 * kv_warps * 16 * row_warps + (kv_warps - 1) * 16 * row_warps * merge_pitch<D>()) * 4;
}

// Which request and which row tile of it CTA column x works on (decode: x = b * tiles_per_request
// + tile; ragged: the device tile map, a request's last tiles first). ok = false: a spare CTA.
struct TileLoc {
  int b, tile, q_start, qo_len;
  bool ok;
};
__device__ __forceinline__ TileLoc locate_tile(const AttentionParams& p, int x) {
  TileLoc t{};
  if (p.qo_indptr == nullptr) {
    t.b = x / p.tiles_per_request;
    t.tile = x % p.tiles_per_request;
    t.q_start = t.b;
    t.qo_len = 1;
    t.ok = true;
    return t;
  }
  t.ok = x < p.tile_offsets[p.batch];
  if (!t.ok) return t;
  int lo = 0, hi = p.batch - 1;  // largest b with tile_offsets[b] <= x
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.tile_offsets[mid] <= x) lo = mid; else hi = mid - 1;
  }
  t.b = lo;
  const int ntiles = p.tile_offsets[lo + 1] - p.tile_offsets[lo];
  t.tile = ntiles - 1 - (x - p.tile_offsets[lo]);  // the last (heaviest when causal) tiles first
  t.q_start = p.qo_indptr[lo];
  t.qo_len = p.qo_indptr[lo + 1] - t.q_start;  // the tile map gave 0 tiles to invalid ranges
  return t;
}

template <typename T, int D, int ROW_WARPS, int KV_WARPS>
// No min-CTAs-per-SM in the launch bounds: tried (3 for the 1 x 4 decode CTA, what shared memory
// allows), ptxas gave the same CTAs per SM (bf16 D 128: 1 x 4 152 registers instead of 156) and
// spent more on the prefill CTA at any value, even 1 (4 x 1: 204 instead of 173).
// tests/ops/test_cuda_build.py checks instead that the 1 x 4 decode CTA keeps >= 12 warps per SM.
__global__ void __launch_bounds__(ROW_WARPS * KV_WARPS * 32) paged_attention_kernel(const AttentionParams p) {
  constexpr int WARPS = ROW_WARPS * KV_WARPS;
  constexpr int SP = pitch<D>();
  constexpr int CH = D / 8;     // 16-byte chunks per row
  constexpr int KS = D / 16;    // k-steps of QK^T
  constexpr int NW = kBlockN / KV_WARPS;  // KV tokens of each tile one warp computes on (its sub-tile)
  constexpr int NT = NW / 8;    // n8 tiles of the warp's S
  constexpr int DT = D / 8;     // n8 tiles of O
  static_assert(NW % 16 == 0, "P V takes 16 tokens per mma k-step");
  static_assert(KV_WARPS == 1 || merge_bytes<D>(ROW_WARPS, KV_WARPS) <= 2 * kStages * kBlockN * SP * sizeof(T),
                "the KV warps' merge must fit in the K/V stages");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  constexpr int nthreads = WARPS * 32;
  constexpr int rows_tile = 16 * ROW_WARPS;
  T* sK = sQ + rows_tile * SP;
  T* sV = sK + kStages * kBlockN * SP;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // the warp's KV sub-tile and 16 rows (kw is 0 at compile time for KV_WARPS = 1: no extra registers)
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

  // -- loaders --------------------------------------------------------------------------------
  const T* qg = reinterpret_cast<const T*>(p.q);
  const T* kg = reinterpret_cast<const T*>(p.k_cache);
  const T* vg = reinterpret_cast<const T*>(p.v_cache);
  for (int idx = tid; idx < rows_tile * CH; idx += nthreads) {
    const int r = idx / CH, c = idx % CH;
    const int pr = row_beg + r;
    const bool valid = !bad && r < rows_valid;
    const T* src = qg;
    if (valid) src = qg + ((long long)(q_start + pr / g) * p.num_heads + kvh * g + pr % g) * D + c * 8;
    cp_async_16(sQ + r * SP + c * 8, src, valid);
  }
  // -- K/V loader ----------------------------------------------------------------------------
  // Per tile, lane l of warp w resolves the pages of "its" rows (warp-rows k = l, l + 32: one
  // coalesced kv_indices load per row, issued a whole tile ahead and validated when used) and
  // holds their 64-bit byte offsets, bit 0 set when the row is to be copied (offsets are multiples
  // of 16); the copy loop takes each row's offset from its owner lane by shuffle: fully unrolled,
  // branch-free, rows past the range or on a bad page copy 0 bytes (cp.async zero fill through
  // src-size = (bit 0) * 16, from offset 0: always a valid address). Warp w copies tile rows
  // it * RPI + w * RPW + (0..RPW-1) in iteration it, i.e. its warp-row k = it * RPW + lane / CH.
  constexpr int RPW = 32 / CH;          // rows a warp copies per iteration (2 for D 128, 4 for D 64)
  constexpr int RPI = WARPS * RPW;      // rows the CTA copies per iteration
  constexpr int ITERS = kBlockN / RPI;  // copy iterations per tile
  constexpr int RW = ITERS * RPW;       // rows per warp per tile
  constexpr int SLOTS = (RW + 31) / 32;  // rows a lane resolves per tile
  static_assert(32 % CH == 0 && kBlockN % RPI == 0 && RW * WARPS == kBlockN, "loader shape");
  const long long row_stride = (long long)p.num_kv_heads * D;  // elements between two tokens of a page
  bool bad_page = false;
  int pidx[SLOTS];        // kv_indices entries of the owned rows of the next tile (prefetched)
  long long base[SLOTS];  // byte offsets of the owned rows (page, row in page, kv head) | 1; 0: no copy
  auto owned_tok = [&](int tok0, int s, bool& in) {  // token of the lane's row in slot s
    const int k = s * 32 + lane;
    in = (RW % 32 == 0 || k < RW) && tok0 + (k / RPW) * RPI + warp * RPW + k % RPW < s_end;
    return tok0 + (k / RPW) * RPI + warp * RPW + k % RPW;
  };
  auto fetch_idx = [&](int t) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      bool in;
      const int tok = owned_tok(s_beg + t * kBlockN, s, in);
      const int pi = p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page_size;
      pidx[s] = p.kv_indices[kv_beg + (in ? pi : 0)];  // branch-free; entry kv_beg exists when there are tiles
    }
  };
  auto make_bases = [&](int t) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      bool in;
      const int tok = owned_tok(s_beg + t * kBlockN, s, in);
      const int pi = p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page_size;
      const bool ok = in && (unsigned)pidx[s] < (unsigned)p.num_pages;
      bad_page |= in && !ok;
      const long long elem = ((long long)pidx[s] * p.page_size + (tok - pi * p.page_size)) * row_stride + kvh * D;
      base[s] = ok ? elem * (long long)sizeof(T) + 1 : 0;
    }
  };
  auto copy_kv = [&](int stage) {
    T* k_dst = sK + stage * kBlockN * SP;
    T* v_dst = sV + stage * kBlockN * SP;
    const int c = lane % CH, sub = lane / CH;
    const char* kc = reinterpret_cast<const char*>(kg + c * 8);
    const char* vc = reinterpret_cast<const char*>(vg + c * 8);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const long long b = __shfl_sync(0xffffffffu, base[(it * RPW) / 32], (it * RPW) % 32 + sub);
      const long long off = b & ~1LL;
      const int src_bytes = (int(b) & 1) << 4;
      const int r = it * RPI + warp * RPW + sub;
      cp_async_16_src(k_dst + r * SP + c * 8, kc + off, src_bytes);
      cp_async_16_src(v_dst + r * SP + c * 8, vc + off, src_bytes);
    }
  };
  if (n_tiles > 0) {
    fetch_idx(0);
    make_bases(0);
    copy_kv(0);
    if (n_tiles > 1) fetch_idx(1);
  }
  cp_async_commit();

  // -- per-thread state: rows lane/4 and lane/4 + 8 of the warp's 16 ------------------------------
  const int wrow0 = rw * 16 + (lane >> 2);
  int limit[2];  // last KV position each of the thread's rows may see (causal); else kv_len - 1
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int pr = row_beg + wrow0 + 8 * i;
    limit[i] = p.causal ? kv_len - qo_len + pr / g : kv_len - 1;
  }
  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  uint32_t qa[KS][4];

  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) {  // tile t+1's pages were fetched during tile t-1: resolve, copy, fetch t+2's
      make_bases(t + 1);
      copy_kv((t + 1) & 1);
      if (t + 2 < n_tiles) fetch_idx(t + 2);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        ldmatrix_x4(qa[ks], sQ + (rw * 16 + (lane & 15)) * SP + ks * 16 + (lane >> 4) * 8);
    }
    // this warp's sub-tile: tile rows kw * NW .. kw * NW + NW - 1
    const T* k_s = sK + ((t & 1) * kBlockN + kw * NW) * SP;
    const T* v_s = sV + ((t & 1) * kBlockN + kw * NW) * SP;
    const int tok0 = s_beg + t * kBlockN + kw * NW;

    // -- S = Q K^T ------------------------------------------------------------------------------
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int nb = 0; nb < NT / 2; ++nb) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_s + (nb * 16 + (lane & 7) + (lane >> 4) * 8) * SP + ks * 16 + ((lane >> 3) & 1) * 8);
        mma_16816<T>(s[2 * nb], qa[ks], kb[0], kb[1]);
        mma_16816<T>(s[2 * nb + 1], qa[ks], kb[2], kb[3]);
      }
    }
    // -- scale + mask ---------------------------------------------------------------------------
    const bool need_mask = tok0 + NW > s_end || (p.causal && tok0 + NW - 1 > min(limit[0], limit[1]));
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * p.scale_log2;
        if (need_mask) {
          const int tok = tok0 + j * 8 + (lane & 3) * 2 + (e & 1);
          if (tok >= s_end || tok > limit[e >> 1]) v = kNegInf;
        }
        s[j][e] = v;
      }
    }
    // -- online softmax -------------------------------------------------------------------------
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i], mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      const float alpha = fast_exp2(m[i] - m_use);
      m[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        s[j][2 * i] = fast_exp2(s[j][2 * i] - m_use);
        s[j][2 * i + 1] = fast_exp2(s[j][2 * i + 1] - m_use);
        sum += s[j][2 * i] + s[j][2 * i + 1];
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        o[j][2 * i] *= alpha;
        o[j][2 * i + 1] *= alpha;
      }
    }
    // -- O += P V ---------------------------------------------------------------------------------
#pragma unroll
    for (int kb = 0; kb < NT / 2; ++kb) {
      uint32_t pa[4];
      pa[0] = pack2<T>(s[2 * kb][0], s[2 * kb][1]);
      pa[1] = pack2<T>(s[2 * kb][2], s[2 * kb][3]);
      pa[2] = pack2<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]);
      pa[3] = pack2<T>(s[2 * kb + 1][2], s[2 * kb + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_s + (kb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * SP + dp * 16 + (lane >> 4) * 8);
        mma_16816<T>(o[2 * dp], pa, vb[0], vb[1]);
        mma_16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // the stage just read is the one the next iteration's load overwrites
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad || bad_page);  // also: every warp is done with the K/V stages

#pragma unroll
  for (int i = 0; i < 2; ++i) {  // row sums over the quad (m is already row-wide)
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const int c2 = (lane & 3) * 2;  // the thread's column pair in each n8 tile of O

  // -- merge the KV warps (split-K inside the CTA) ------------------------------------------------
  // Warp (rw, kw) holds m (log2 domain), l and the unnormalized o of rows rw * 16.. over its own
  // sub-tiles. Every warp rescales to the row maximum over the KV warps, M, and computes the common
  // L = sum_k l_k 2^(m_k - M); warps kw >= 1 hand their o to warp kw = 0 through shared memory
  // (the K/V stages, free now), which adds them up and runs the epilogue. A warp that saw no key
  // (m = -inf) contributes 2^-inf = 0; no key at all gives M = -inf, L = 0: out 0, lse -inf.
  if constexpr (KV_WARPS > 1) {
    constexpr int OP = merge_pitch<D>();
    float* s_m = reinterpret_cast<float*>(sK);  // [KV_WARPS][rows_tile]
    float* s_l = s_m + KV_WARPS * rows_tile;     // [KV_WARPS][rows_tile]
    float* s_o = s_l + KV_WARPS * rows_tile;     // [KV_WARPS - 1][rows_tile][OP]
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
        o[j][2 * i] *= f;
        o[j][2 * i + 1] *= f;
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
          *reinterpret_cast<float2*>(dst + 8 * i * OP + j * 8) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
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
          o[j][2 * i] += v.x;
          o[j][2 * i + 1] += v.y;
        }
    }
  }

  // -- epilogue (warps kw = 0): rows lane/4 (+8) of this warp; row -> (query token, head) --------
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = wrow0 + 8 * i;
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
        const float a = bad ? nan_f() : o[j][2 * i] * inv, bb = bad ? nan_f() : o[j][2 * i + 1] * inv;
        *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(a, bb);
      }
      if ((lane & 3) == 0 && p.lse != nullptr) p.lse[rh] = lse_v;
    } else {
      const long long prh = (long long)split * p.num_qo * p.num_heads + rh;
      float* dst = p.part_out + prh * D + c2;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        const float a = bad ? nan_f() : o[j][2 * i] * inv, bb = bad ? nan_f() : o[j][2 * i + 1] * inv;
        *reinterpret_cast<float2*>(dst + j * 8) = make_float2(a, bb);
      }
      if ((lane & 3) == 0) p.part_lse[prh] = lse_v;
    }
  }
}

// Merge the splits' partial (out, lse) by log-sum-exp over the same (tile, kv head) grid as the
// attention kernel, so exactly the rows some tile computed are written (a row of an invalid
// qo range has no tile, and its output stays untouched, as with one split). All splits empty
// (an empty KV range) gives out = 0, lse = -inf; a NaN partial (bad page table) stays NaN.
template <typename T, int D>
__global__ void __launch_bounds__(256) merge_splits_kernel(const AttentionParams p, int rows_tile) {
  const TileLoc loc = locate_tile(p, blockIdx.x);
  if (!loc.ok) return;
  const int g = p.group, kvh = blockIdx.y;
  const int row_beg = loc.tile * rows_tile;
  const int rows_valid = min(rows_tile, loc.qo_len * g - row_beg);
  const long long split_stride = (long long)p.num_qo * p.num_heads;
  T* out = reinterpret_cast<T*>(p.out);
  for (int idx = threadIdx.x; idx < rows_valid * (D / 4); idx += blockDim.x) {
    const int pr = row_beg + idx / (D / 4);
    const int d = (idx % (D / 4)) * 4;
    const long long rh = (long long)(loc.q_start + pr / g) * p.num_heads + kvh * g + pr % g;
    float m = kNegInf;
    for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.part_lse[s * split_stride + rh]);
    const float m_use = m == kNegInf ? 0.f : m;
    float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = __expf(p.part_lse[s * split_stride + rh] - m_use);
      const float4 v = *reinterpret_cast<const float4*>(p.part_out + (s * split_stride + rh) * D + d);
      sum += w;
      acc[0] += w * v.x;
      acc[1] += w * v.y;
      acc[2] += w * v.z;
      acc[3] += w * v.w;
    }
    const float inv = sum > 0.f ? 1.f / sum : (sum == 0.f ? 0.f : sum);  // NaN sum stays NaN
    uint2 packed;
    packed.x = pack2<T>(acc[0] * inv, acc[1] * inv);
    packed.y = pack2<T>(acc[2] * inv, acc[3] * inv);
    *reinterpret_cast<uint2*>(out + rh * D + d) = packed;
    if (d == 0 && p.lse != nullptr) p.lse[rh] = m_use + __logf(sum);
  }
}

// tile_offsets[b] = sum over b' < b of ceil(qo_len_b' * group / rows_tile); invalid ranges get 0
// tiles. One block; each thread scans a contiguous run of requests.
__global__ void __launch_bounds__(1024) tile_map_kernel(const int32_t* qo_indptr, int batch, int num_qo, int group,
                                                        int rows_tile, int32_t* tile_offsets) {
  __shared__ int sums[1024];
  const int t = threadIdx.x, n = blockDim.x;
  const int per = (batch + n - 1) / n;
  const int b0 = min(batch, t * per), b1 = min(batch, b0 + per);
  auto tiles_of = [&](int b) {
    const int q0 = qo_indptr[b], q1 = qo_indptr[b + 1];
    if (q0 < 0 || q1 < q0 || q1 > num_qo) return 0;
    return int(((long long)(q1 - q0) * group + rows_tile - 1) / rows_tile);
  };
  int local = 0;
  for (int b = b0; b < b1; ++b) local += tiles_of(b);
  sums[t] = local;
  __syncthreads();
  for (int off = 1; off < n; off <<= 1) {
    const int v = t >= off ? sums[t - off] : 0;
    __syncthreads();
    sums[t] += v;
    __syncthreads();
  }
  int run = sums[t] - local;
  for (int b = b0; b < b1; ++b) {
    tile_offsets[b] = run;
    run += tiles_of(b);
  }
  if (t == n - 1) tile_offsets[batch] = sums[t];
}

// Fewest splits whose CTA count fills the resident slots evenly (>= 90% of the last wave), each
// split keeping at least 2 KV tiles (so the two-stage pipeline still overlaps); else the best fill.
int choose_splits(long long base_ctas, int slots, long long est_kv_len) {
  if (base_ctas <= 0 || slots <= 0) return 1;
  const int max_splits = int(std::max<long long>(1, std::min<long long>(32, est_kv_len / (2 * kBlockN))));
  int best = 1;
  double best_eff = 0.0;
  for (int s = 1; s <= max_splits; ++s) {
    const long long ctas = base_ctas * s;
    const long long waves = (ctas + slots - 1) / slots;
    const double eff = double(ctas) / double(waves * slots);
    if (eff >= 0.9) return s;
    if (eff > best_eff + 1e-9) {
      best_eff = eff;
      best = s;
    }
  }
  return best;
}

// Once per kernel configuration (T, D, row x KV warps) and device, not per call: opt in to the
// dynamic shared memory and query the occupancy (the cache is per template instantiation).
// Benign race: two first callers both compute the same value.
template <typename T, int D, int ROW_WARPS, int KV_WARPS>
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
  auto kernel = paged_attention_kernel<T, D, ROW_WARPS, KV_WARPS>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, ROW_WARPS * KV_WARPS * 32, smem);
  if (err != cudaSuccess) return err;
  if (slot != nullptr) slot->store(*per_sm + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

template <typename T, int D, int ROW_WARPS, int KV_WARPS>
cudaError_t launch_typed(AttentionParams p, int64_t est_kv_len, int num_sms, WorkspaceAllocator& alloc,
                         cudaStream_t stream) {
  const bool ragged = p.qo_indptr != nullptr;
  constexpr int warps = ROW_WARPS * KV_WARPS;
  constexpr int rows_tile = 16 * ROW_WARPS;
  const size_t smem = smem_bytes<D>(ROW_WARPS);
  auto kernel = paged_attention_kernel<T, D, ROW_WARPS, KV_WARPS>;
  int per_sm = 0;
  cudaError_t err = kernel_setup<T, D, ROW_WARPS, KV_WARPS>(smem, &per_sm);
  if (err != cudaSuccess) return err;

  long long grid_x;
  long long est_ctas;
  if (ragged) {
    grid_x = ((long long)p.num_qo * p.group + rows_tile - 1) / rows_tile + p.batch;
    est_ctas = ((long long)p.num_qo * p.group + rows_tile - 1) / rows_tile;
    p.tiles_per_request = 0;
  } else {
    p.tiles_per_request = (p.group + rows_tile - 1) / rows_tile;
    grid_x = (long long)p.batch * p.tiles_per_request;
    est_ctas = grid_x;
  }
  if (grid_x == 0 || p.num_qo == 0) return cudaSuccess;
  est_ctas = std::max<long long>(1, est_ctas) * p.num_kv_heads;

  p.num_splits = choose_splits(est_ctas, std::max(1, per_sm) * num_sms, est_kv_len);

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

// 4 warps per CTA, as row warps x KV warps. Prefill / shared prefix: 4 x 1 (64 rows). Decode: the
// fewest 16-row warps that hold the GQA group, the rest split each KV tile (1 x 4 for group <= 16,
// 2 x 2 for <= 32), else 4 x 1 and several row tiles per request.
template <typename T, int D>
cudaError_t launch_typed(AttentionParams p, int64_t est_kv_len, int num_sms, WorkspaceAllocator& alloc,
                         cudaStream_t stream) {
  if (p.qo_indptr == nullptr && p.group <= 16) return launch_typed<T, D, 1, 4>(p, est_kv_len, num_sms, alloc, stream);
  if (p.qo_indptr == nullptr && p.group <= 32) return launch_typed<T, D, 2, 2>(p, est_kv_len, num_sms, alloc, stream);
  return launch_typed<T, D, kMaxRowWarps, 1>(p, est_kv_len, num_sms, alloc, stream);
}

}  // namespace

cudaError_t launch_paged_attention(AttentionParams p, bool dtype_is_bf16, int head_dim, int64_t est_kv_len,
                                   int num_sms, WorkspaceAllocator& alloc, cudaStream_t stream) {
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
