// The K/V loader of the paged attention kernel (attention_kernel.cu): gathers a request's 64-token
// KV tiles for one kv head through the page table into shared memory with 16-byte cp.async, branch-
// free, page entries fetched a tile ahead. Included by attention_kernel.cu and attention_wgmma.cu
// (anonymous namespace: a copy per translation unit).
//
// Per tile, lane l of warp w resolves the pages of "its" rows (warp-rows k = l, l + 32: one coalesced
// kv_indices load per row, issued a whole tile ahead (fetch_idx) and validated when used
// (make_bases)) and holds their 64-bit byte offsets, bit 0 set when the row is to be copied (offsets
// are multiples of 16); the copy loop (copy_kv) takes each row's offset from its owner lane by
// shuffle: fully unrolled, branch-free, rows past the range or on a bad page copy 0 bytes (cp.async
// zero fill through src-size = (bit 0) * 16, from offset 0: always a valid address). Warp w copies
// tile rows it * RPI + w * RPW + (0..RPW-1) in iteration it, i.e. its warp-row k = it * RPW + lane / CH.
#pragma once

#include "cuda/attention_utils.cuh"

namespace minisched::cuda {
namespace {

constexpr int kBlockN = 64;  // KV tokens per tile

template <typename T, int D, int WARPS>
struct KvLoader {
  static constexpr int CH = D / 8;              // 16-byte chunks per row
  static constexpr int RPW = 32 / CH;           // rows a warp copies per iteration (2 for D 128, 4 for D 64)
  static constexpr int RPI = WARPS * RPW;       // rows the CTA copies per iteration
  static constexpr int ITERS = kBlockN / RPI;   // copy iterations per tile
  static constexpr int RW = ITERS * RPW;        // rows per warp per tile
  static constexpr int SLOTS = (RW + 31) / 32;  // rows a lane resolves per tile
  static_assert(32 % CH == 0 && kBlockN % RPI == 0 && RW * WARPS == kBlockN, "loader shape");

  const AttentionParams& p;
  const int lane, warp, kvh, kv_beg, s_beg, s_end;
  const long long row_stride;  // elements between two tokens of a page
  bool bad_page = false;
  int pidx[SLOTS];        // kv_indices entries of the owned rows of the next tile (prefetched)
  long long base[SLOTS];  // byte offsets of the owned rows (page, row in page, kv head) | 1; 0: no copy

  __device__ __forceinline__ KvLoader(const AttentionParams& p_, int lane_, int warp_, int kvh_, int kv_beg_,
                                      int s_beg_, int s_end_)
      : p(p_),
        lane(lane_),
        warp(warp_),
        kvh(kvh_),
        kv_beg(kv_beg_),
        s_beg(s_beg_),
        s_end(s_end_),
        row_stride((long long)p_.num_kv_heads * D) {}

  __device__ __forceinline__ int owned_tok(int tok0, int s, bool& in) const {  // token of the lane's row in slot s
    const int k = s * 32 + lane;
    const int tok = tok0 + (k / RPW) * RPI + warp * RPW + k % RPW;
    in = (RW % 32 == 0 || k < RW) && tok < s_end;
    return tok;
  }
  __device__ __forceinline__ int page_of(int tok) const {
    return p.page_shift >= 0 ? tok >> p.page_shift : tok / p.page_size;
  }
  // kv_indices entries of tile t's owned rows (issued a tile ahead of make_bases)
  __device__ __forceinline__ void fetch_idx(int t) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      bool in;
      const int tok = owned_tok(s_beg + t * kBlockN, s, in);
      // branch-free; entry kv_beg exists when there are tiles
      pidx[s] = p.kv_indices[kv_beg + (in ? page_of(tok) : 0)];
    }
  }
  // validate the fetched entries, keep the byte offsets | copy bit
  __device__ __forceinline__ void make_bases(int t) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      bool in;
      const int tok = owned_tok(s_beg + t * kBlockN, s, in);
      const int pi = page_of(tok);
      const bool ok = in && (unsigned)pidx[s] < (unsigned)p.num_pages;
      bad_page |= in && !ok;
      const long long elem = ((long long)pidx[s] * p.page_size + (tok - pi * p.page_size)) * row_stride + kvh * D;
      base[s] = ok ? elem * (long long)sizeof(T) + 1 : 0;
    }
  }
  // the tile's K and V rows into stage `stage` of sK / sV (kBlockN rows of pitch SP elements per stage)
  template <int SP>
  __device__ __forceinline__ void copy_kv(T* sK, T* sV, int stage) const {
    copy_kv_to(sK + stage * kBlockN * SP, sV + stage * kBlockN * SP, [](int r, int c) { return r * SP + c * 8; });
  }
  // The same copy into any shared layout: tile row r, 16-byte chunk c goes to element dst_off(r, c) of
  // k_dst / v_dst (the wgmma kernel's 128-byte swizzle, attention_wgmma.cu).
  template <class DstOff>
  __device__ __forceinline__ void copy_kv_to(T* k_dst, T* v_dst, DstOff dst_off) const {
    const int c = lane % CH, sub = lane / CH;
    const char* kc = reinterpret_cast<const char*>(reinterpret_cast<const T*>(p.k_cache) + c * 8);
    const char* vc = reinterpret_cast<const char*>(reinterpret_cast<const T*>(p.v_cache) + c * 8);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const long long b = __shfl_sync(0xffffffffu, base[(it * RPW) / 32], (it * RPW) % 32 + sub);
      const long long off = b & ~1LL;
      const int src_bytes = (int(b) & 1) << 4;
      const int r = it * RPI + warp * RPW + sub;
      cp_async_16_src(k_dst + dst_off(r, c), kc + off, src_bytes);
      cp_async_16_src(v_dst + dst_off(r, c), vc + off, src_bytes);
    }
  }
};

}  // namespace
}  // namespace minisched::cuda
