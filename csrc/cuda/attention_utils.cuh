// Shared pieces of the CUDA kernels: 16-bit type traits, cp.async / ldmatrix / mma.sync
// wrappers (sm_80+ PTX, built for sm_90a), and the params struct + host launcher of the one
// paged attention kernel behind paged_decode_attention, paged_prefill_attention and
// shared_prefix_attention (csrc/cuda/attention_kernel.cu).
//
// Framework-free on the device side: kernels take raw pointers, sizes and strides.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace minisched::cuda {

// -- 16-bit element types ------------------------------------------------------------------------

template <typename T>
struct Half2Of;
template <>
struct Half2Of<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Half2Of<__half> {
  using type = __half2;
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};

// Two floats -> one 32-bit register holding two 16-bit values (low = a).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  auto h = Half2Of<T>::from_floats(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// -- cp.async (global -> shared, 16 bytes, zero-filled when src_bytes == 0) ----------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
// The same with the source size given (16: copy, 0: zero fill), for branch-free loaders.
__device__ __forceinline__ void cp_async_16_src(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// -- ldmatrix / mma.sync m16n8k16 (fp32 accumulate) --------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// d += a * b for a 16x16 (row) by 16x8 (col) tile. a: 4 regs, b: 2 regs, d: 4 floats.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// -- the paged attention kernel's parameters -----------------------------------------------------
//
// Work: query rows are (query token, q head of the kv head's GQA group) pairs, packed
// p = token * group + head_in_group, and cut into tiles of rows_tile rows (16 x row fragments per
// warp x row warps: 128 for prefill / shared prefix, 16-64 for decode); one CTA takes one
// tile of one request (or group), one kv head and one KV split, and reads that request's KV
// pages for the kv head once for all the tile's rows (the whole GQA group).
//
// Requests: decode has one query per request (qo_indptr == nullptr: request b owns q row b);
// prefill and shared-prefix pass qo_indptr (ragged rows) and a device tile map (tile_offsets).
//
// Bad page-table entries (page index outside [0, num_pages), indptr/last_page_len/qo_indptr
// inconsistent with the pool or the query count) are never dereferenced: that request's output
// rows (and LSE) are written as NaN instead. The host wrappers cannot check index values of
// CUDA tensors without a device sync, so this is the documented CUDA behaviour. A request with
// no pages (kv_indptr[b] == kv_indptr[b+1]) is not bad: an empty KV range, out 0 and lse -inf.
struct AttentionParams {
  const void* q;        // [num_qo, Hq, D]
  const void* k_cache;  // [num_pages, page_size, Hkv, D]
  const void* v_cache;
  void* out;                        // [num_qo, Hq, D] (num_splits == 1)
  float* lse;                       // [num_qo, Hq] or nullptr (num_splits == 1)
  float* part_out;                  // [num_splits, num_qo, Hq, D] (num_splits > 1)
  float* part_lse;                  // [num_splits, num_qo, Hq]     (num_splits > 1)
  const int32_t* qo_indptr;         // [B+1] or nullptr (one query per request)
  const int32_t* tile_offsets;      // [B+1] device tile map when qo_indptr is set
  const int32_t* kv_indptr;         // [B+1]
  const int32_t* kv_indices;        // [nnz]
  const int32_t* kv_last_page_len;  // [B]
  int batch;
  int num_qo;
  int num_heads;     // Hq
  int num_kv_heads;  // Hkv
  int group;         // Hq / Hkv
  int num_pages;
  int page_size;
  int page_shift;  // log2(page_size) when a power of two, else -1
  int nnz;         // len(kv_indices)
  int num_splits;
  int tiles_per_request;  // decode: ceil(group / rows_tile)
  bool causal;
  float scale_log2;  // sm_scale * log2(e)
};

// Chooses warps per CTA and the number of KV splits, then launches (plus the tile-map and
// split-merge kernels when needed) on `stream`. dtype_is_bf16 picks bf16 or fp16; head_dim is
// 64 or 128. est_kv_len: an estimate of the mean KV length (host-known, for the split choice).
// Returns a cudaError_t (the last launch's error).
// Work buffers (tile map, split partials) are provided by the caller through `alloc`.
struct WorkspaceAllocator {
  virtual void* allocate(size_t bytes) = 0;
  virtual ~WorkspaceAllocator() = default;
};

cudaError_t launch_paged_attention(AttentionParams p, bool dtype_is_bf16, int head_dim, int64_t est_kv_len, int num_sms,
                                   WorkspaceAllocator& alloc, cudaStream_t stream);

// The Hopper prefill kernel (attention_wgmma.cu, sm_90a): ragged rows only (p.qo_indptr set), one KV
// split, bf16 / fp16, head_dim 64 / 128 (else cudaErrorInvalidValue).
cudaError_t launch_paged_attention_wgmma(AttentionParams p, bool dtype_is_bf16, int head_dim, WorkspaceAllocator& alloc,
                                         cudaStream_t stream);

}  // namespace minisched::cuda
