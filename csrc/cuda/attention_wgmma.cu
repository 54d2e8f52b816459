// The Hopper prefill path of paged_prefill_attention ("FA3-lite"; NOTES.md "Prefill kernel (wgmma)"):
// the same work split as the mma.sync kernel's 128-row prefill CTA (attention_kernel.cu: rows
// p = token * group + h of one kv head's GQA group, the device tile map, bottom-right causal,
// bad-table NaN rows, the empty-range rule), with both GEMMs on warpgroup MMA (wgmma.mma_async):
// - CTA = 2 warpgroups (256 threads) x 64 query rows = 128-row tile; one KV split only (the
//   launcher in torch_glue.cuh keeps the mma.sync kernel for everything else).
// - S = Q K^T: wgmma m64n64k16, A = Q and B = K from shared memory (K-major, 128B swizzle).
// - Online softmax (log2 domain) on the f32 accumulator registers, P cast to 16 bits in registers.
// - O += P V: wgmma m64n{D}k16, A = P from registers, B = V from shared memory (MN-major, transposed).
// - K/V tiles of 64 tokens gathered through the page table by all 256 threads with 16-byte cp.async
//   (KvLoader, attention_loader.cuh) straight into the swizzled layout, 2 stages; after the data
//   arrived: fence.proxy.async (cp.async writes through the generic proxy, wgmma reads through the
//   async proxy) + barrier.
// Not (yet): TMA, producer-warp specialization, softmax/GEMM overlap across warpgroups (FA3's
// ping-pong); each warpgroup waits for its own GEMMs.
#include "cuda/attention_loader.cuh"
#include "cuda/attention_tile_map.cuh"
#include "cuda/attention_utils.cuh"
#include "cuda/wgmma_utils.cuh"

#include <atomic>
#include <cmath>

namespace minisched::cuda {
namespace {

constexpr int kRows = 128;     // query rows per CTA
constexpr int kThreads = 256;  // 2 warpgroups
constexpr float kLn2w = 0.6931471805599453f;

// Shared memory: Q [D/64][128][64], then 2 stages of K [D/64][64][64], then 2 of V, all swizzled;
// every 64-column block is a multiple of 1024 bytes, so each region starts on a 1024-byte boundary
// when the base does (the kernel aligns the base; +1024 bytes of slack).
template <int D>
constexpr int q_bytes() {
  return kRows * D * 2;
}
template <int D>
constexpr int kv_stage_bytes() {
  return kBlockN * D * 2;
}
template <int D>
constexpr size_t wgmma_smem_bytes() {
  return size_t(q_bytes<D>() + 4 * kv_stage_bytes<D>() + 1024);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) paged_attention_wgmma_kernel(const AttentionParams p) {
  constexpr int CH = D / 8;   // 16-byte chunks per row
  constexpr int KS = D / 16;  // k-steps of Q K^T
  constexpr int DT = D / 8;   // n8 column tiles of O
  constexpr int SBO = 1024;   // 8 rows x 128 bytes: the next 8-row group (K-major) / 8-token group (MN-major)
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  unsigned char* base = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(base);
  T* sK = reinterpret_cast<T*>(base + q_bytes<D>());
  T* sV = reinterpret_cast<T*>(base + q_bytes<D>() + 2 * kv_stage_bytes<D>());

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2;  // warpgroup: CTA rows 64 wg .. 64 wg + 63
  const int kvh = blockIdx.y, g = p.group;

  const TileLoc loc = locate_tile(p, blockIdx.x);
  if (!loc.ok) return;
  const int b = loc.b, q_start = loc.q_start, qo_len = loc.qo_len;
  const int row_beg = loc.tile * kRows;
  const int rows_valid = min(kRows, qo_len * g - row_beg);

  // -- request validity, as attention_kernel.cu --------------------------------------------------
  const int kv_beg = p.kv_indptr[b], kv_endp = p.kv_indptr[b + 1], last = p.kv_last_page_len[b];
  bool bad = !(kv_beg >= 0 && kv_beg <= kv_endp && kv_endp <= p.nnz && last >= 1 && last <= p.page_size);
  const long long kv_len_ll = kv_endp > kv_beg ? (long long)(kv_endp - kv_beg - 1) * p.page_size + last : 0;
  bad = bad || kv_len_ll > 0x7fffffffLL || (p.causal && kv_len_ll < qo_len);
  const int kv_len = bad ? 0 : int(kv_len_ll);

  // -- KV range (one split), cut at the causal limit of the tile's last row ------------------------
  int s_end = kv_len;
  if (p.causal && rows_valid > 0) s_end = min(s_end, kv_len - qo_len + (row_beg + rows_valid - 1) / g + 1);
  const int n_tiles = (bad || s_end <= 0) ? 0 : (s_end + kBlockN - 1) / kBlockN;

  // -- Q tile (swizzled) and the first K/V tile -----------------------------------------------------
  const T* qg = reinterpret_cast<const T*>(p.q);
  for (int idx = tid; idx < kRows * CH; idx += kThreads) {
    const int r = idx / CH, c = idx % CH;
    const int pr = row_beg + r;
    const bool valid = !bad && r < rows_valid;
    const T* src = qg;
    if (valid) src = qg + ((long long)(q_start + pr / g) * p.num_heads + kvh * g + pr % g) * D + c * 8;
    cp_async_16(sQ + wgmma::sw128_elem(r, c, kRows), src, valid);
  }
  auto kv_off = [](int r, int c) { return wgmma::sw128_elem(r, c, kBlockN); };
  constexpr int KV_ELEMS = kBlockN * D;  // elements per K or V stage
  KvLoader<T, D, kThreads / 32> kv(p, lane, warp, kvh, kv_beg, 0, s_end);
  if (n_tiles > 0) {
    kv.fetch_idx(0);
    kv.make_bases(0);
    kv.copy_kv_to(sK, sV, kv_off);
    if (n_tiles > 1) kv.fetch_idx(1);
  }
  cp_async_commit();

  // -- descriptors: Q of this warpgroup, K and V of stage 0 (k-steps and stages are byte offsets) ---
  const uint64_t dq = wgmma::make_desc(smem_addr(sQ) + wg * 64 * 128, 16, SBO);
  const uint64_t dk = wgmma::make_desc(smem_addr(sK), 16, SBO);
  const uint64_t dv = wgmma::make_desc(smem_addr(sV), kBlockN * 128, SBO);  // LBO: the next 64 d-columns

  // -- per-thread rows: 64 wg + 16 (warp % 4) + lane / 4 + 8 h, h = 0, 1 ------------------------------
  const int trow0 = wg * 64 + (warp & 3) * 16 + (lane >> 2);
  int lim[2];  // last KV position row h may see
#pragma unroll
  for (int h = 0; h < 2; ++h)
    lim[h] = min(s_end, p.causal ? kv_len - qo_len + (row_beg + trow0 + 8 * h) / g + 1 : kv_len) - 1;
  float o[D / 2], s[32];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int t = 0; t < n_tiles; ++t) {
    // tile t (and Q) arrived for this thread -> visible to the async proxy -> for every thread; every
    // warpgroup has waited for its wgmma of tile t - 1, so stage (t + 1) & 1 is free
    cp_async_wait<0>();
    wgmma::fence_proxy_async();
    __syncthreads();
    if (t + 1 < n_tiles) {
      kv.make_bases(t + 1);
      kv.copy_kv_to(sK + ((t + 1) & 1) * KV_ELEMS, sV + ((t + 1) & 1) * KV_ELEMS, kv_off);
      if (t + 2 < n_tiles) kv.fetch_idx(t + 2);
    }
    cp_async_commit();
    const uint32_t stage_off = (t & 1) * kv_stage_bytes<D>();

    // -- S = Q K^T (64 x 64 per warpgroup); k-step ks: column block ks / 4, 32 bytes per step in it --
    wgmma::fence_regs(s);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint32_t koff = (ks >> 2) * 8192 + (ks & 3) * 32;  // 8192 = 64 rows x 128 bytes
      wgmma::mma_ss_n64<T>(s, wgmma::desc_add(dq, (ks >> 2) * kRows * 128 + (ks & 3) * 32),
                           wgmma::desc_add(dk, stage_off + koff), ks > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_regs(s);

    // -- scale, mask, online softmax: register 4 j + 2 h + e = row h, column 8 j + 2 (lane % 4) + e --
    const int tok0 = t * kBlockN + 2 * (lane & 3);
    const bool need_mask = t * kBlockN + kBlockN - 1 > lim[0];  // lim[0] <= lim[1]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = s[4 * j + 2 * h + e] * p.scale_log2;
          if (need_mask && tok0 + 8 * j + e > lim[h]) v = -INFINITY;
          s[4 * j + 2 * h + e] = v;
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp2(m[h] - m_use);
      m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float e2 = fast_exp2(s[4 * j + 2 * h + e] - m_use);
          s[4 * j + 2 * h + e] = e2;
          sum += e2;
        }
      l[h] = l[h] * alpha + sum;
#pragma unroll
      for (int j = 0; j < DT; ++j) {
        o[4 * j + 2 * h] *= alpha;
        o[4 * j + 2 * h + 1] *= alpha;
      }
    }
    // -- P (16-bit A fragments: k-step kb = S columns 16 kb .. 16 kb + 15 = n8 tiles 2 kb, 2 kb + 1) --
    uint32_t pa[4][4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      pa[kb][0] = pack2<T>(s[8 * kb + 0], s[8 * kb + 1]);
      pa[kb][1] = pack2<T>(s[8 * kb + 2], s[8 * kb + 3]);
      pa[kb][2] = pack2<T>(s[8 * kb + 4], s[8 * kb + 5]);
      pa[kb][3] = pack2<T>(s[8 * kb + 6], s[8 * kb + 7]);
    }
    // -- O += P V: k-step kb = tokens 16 kb .., 16 rows x 128 bytes = 2048 bytes into the stage ------
    wgmma::fence_regs(o);
    wgmma::fence();
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) wgmma::mma_rs<T, D>(o, pa[kb], wgmma::desc_add(dv, stage_off + kb * 2048));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_regs(o);
  }
  cp_async_wait<0>();
  bad = __syncthreads_or(bad || kv.bad_page);

  // -- epilogue: the thread's two rows; row -> (query token, head) ------------------------------------
  T* out = reinterpret_cast<T*>(p.out);
  const int c2 = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int r = trow0 + 8 * h;
    if (r >= rows_valid) continue;
    const int pr = row_beg + r;
    const long long rh = (long long)(q_start + pr / g) * p.num_heads + kvh * g + pr % g;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    float lse_v = l[h] > 0.f ? (m[h] + __log2f(l[h])) * kLn2w : -INFINITY;
    if (bad) lse_v = __int_as_float(0x7fc00000);
    T* dst = out + rh * D + c2;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      const float a = bad ? __int_as_float(0x7fc00000) : o[4 * j + 2 * h] * inv;
      const float bb = bad ? __int_as_float(0x7fc00000) : o[4 * j + 2 * h + 1] * inv;
      *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(a, bb);
    }
    if ((lane & 3) == 0 && p.lse != nullptr) p.lse[rh] = lse_v;
  }
}

// Dynamic shared memory opt-in, once per instantiation and device (benign race, as attention_kernel.cu).
template <typename T, int D>
cudaError_t wgmma_setup() {
  constexpr int kDevices = 64;
  static std::atomic<bool> done[kDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kDevices && done[dev].load(std::memory_order_relaxed)) return cudaSuccess;
  err = cudaFuncSetAttribute(paged_attention_wgmma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(wgmma_smem_bytes<D>()));
  if (err == cudaSuccess && dev >= 0 && dev < kDevices) done[dev].store(true, std::memory_order_relaxed);
  return err;
}

template <typename T, int D>
cudaError_t launch_wgmma_typed(AttentionParams p, WorkspaceAllocator& alloc, cudaStream_t stream) {
  cudaError_t err = wgmma_setup<T, D>();
  if (err != cudaSuccess) return err;
  p.num_splits = 1;
  p.part_out = nullptr;
  p.part_lse = nullptr;
  p.tiles_per_request = 0;
  const long long grid_x = grid_columns(p, kRows);  // ceil(num_qo * group / 128) + batch
  if (grid_x == 0 || p.num_qo == 0) return cudaSuccess;
  auto* offsets = static_cast<int32_t*>(alloc.allocate(sizeof(int32_t) * (p.batch + 1)));
  tile_map_kernel<<<1, 1024, 0, stream>>>(p.qo_indptr, p.batch, p.num_qo, p.group, kRows, offsets);
  p.tile_offsets = offsets;
  paged_attention_wgmma_kernel<T, D>
      <<<dim3(unsigned(grid_x), unsigned(p.num_kv_heads), 1), kThreads, wgmma_smem_bytes<D>(), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_paged_attention_wgmma(AttentionParams p, bool dtype_is_bf16, int head_dim, WorkspaceAllocator& alloc,
                                         cudaStream_t stream) {
  if (p.qo_indptr == nullptr) return cudaErrorInvalidValue;  // prefill (ragged rows) only
  if (dtype_is_bf16) {
    if (head_dim == 64) return launch_wgmma_typed<__nv_bfloat16, 64>(p, alloc, stream);
    if (head_dim == 128) return launch_wgmma_typed<__nv_bfloat16, 128>(p, alloc, stream);
  } else {
    if (head_dim == 64) return launch_wgmma_typed<__half, 64>(p, alloc, stream);
    if (head_dim == 128) return launch_wgmma_typed<__half, 128>(p, alloc, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace minisched::cuda
