// Hopper warpgroup MMA (wgmma.mma_async, sm_90a) wrappers for the wgmma prefill kernel
// (attention_wgmma.cu): the 128-byte swizzled shared-memory layout its loaders write, the shared-
// memory matrix descriptors, fences, and the two instruction shapes it uses.
//
// Facts (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate": matrix descriptor
// format, canonical layouts, swizzling modes, register fragments of .m64nNk16; the same as CUTLASS
// cute/arch/mma_sm90_desc.hpp and cute/atom/mma_traits_sm90_gmma.hpp):
// - Descriptor (64 bits): [0,14) start address >> 4, [16,30) leading dimension byte offset (LBO)
//   >> 4, [32,46) stride dimension byte offset (SBO) >> 4, [49,52) base offset (0: every swizzle
//   atom starts on a 1024-byte boundary), [62,64) swizzle mode (1 = 128B).
// - 128B swizzle (cute Swizzle<3,4,3>): a byte address's 16-byte chunk bits [4,7) are XORed with
//   its bits [7,10), i.e. chunk c of 128-byte row r (of a 1024-byte aligned 8-row atom) lives at
//   chunk c ^ (r % 8). The hardware applies it to the address it computes, so a descriptor may
//   start 32 bytes into an atom (the k-steps inside a 64-element row).
// - K-major operand (the contraction dim contiguous: Q [row][d], K [token][d]), canonical layout in
//   16-byte units ((8, n), 2) : ((8, SBO), 1): 8 rows 128 bytes apart, groups of 8 rows SBO apart;
//   a k16 step reads 2 chunks (32 bytes) of each row. LBO is unused with swizzling.
// - MN-major operand (V [token][d] as B of P V: N = d contiguous, transpose bit 1), canonical layout
//   ((8, n), (8, k)) : ((1, LBO), (8, SBO)): 64 N-elements (128 bytes) contiguous, the next 64 at
//   LBO; 8 K-rows 128 bytes apart, the next 8 K-rows at SBO.
// - Accumulator of m64nN (f32): warp w of the warpgroup holds rows 16 w + lane / 4 (+ 8); register
//   4 j + 2 h + e is row 16 w + lane / 4 + 8 h, column 8 j + 2 (lane % 4) + e: per warp exactly the
//   mma.sync m16n8k16 C fragment of n8 tile j. Register A of m64nNk16 (16-bit): a0 (row lane / 4,
//   cols 2 (lane % 4) + {0, 1}), a1 (row + 8), a2 (cols + 8), a3 (row + 8, cols + 8) of the warp's
//   16 rows: the m16n8k16 A fragment, so P's accumulator converts to A with no data movement.
//
// Everything here is compiled for sm_90a only (the extension builds for TORCH_CUDA_ARCH_LIST=9.0a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace minisched::cuda::wgmma {

// Element offset of (row r, 16-byte chunk c) in a tile of R rows of 64-element (128-byte) swizzled
// rows, stored as [c / 8 column block][R rows][64]: the layout both descriptor kinds above read
// when every column block is R x 128 bytes, 1024-byte aligned.
__host__ __device__ constexpr int sw128_elem(int r, int c, int R) {
  return ((c >> 3) * R + r) * 64 + (((c & 7) ^ (r & 7)) << 3);
}

constexpr uint64_t kSwizzle128 = uint64_t(1) << 62;

// Descriptor of a swizzled (128B) operand starting at shared address `addr` (bytes).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | kSwizzle128;
}
// The same descriptor moved by `bytes` (a multiple of 16; the start address field cannot carry:
// shared addresses are < 2^18).
__device__ __forceinline__ uint64_t desc_add(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }

// Generic-proxy writes (cp.async) -> async-proxy reads (wgmma): each writer fences after its data
// arrived, then a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across the fence/wait (wgmma
// writes them asynchronously, the asm statements do not say so).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

#define MS_ACC8(i)                                                                                            \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define MS_ACC32 MS_ACC8(0), MS_ACC8(8), MS_ACC8(16), MS_ACC8(24)
#define MS_ACC64 MS_ACC32, MS_ACC8(32), MS_ACC8(40), MS_ACC8(48), MS_ACC8(56)
#define MS_R32                                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MS_R64                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "     \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, " \
  "%41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, " \
  "%61, %62, %63}"

template <typename T>
struct Ty;
template <>
struct Ty<__nv_bfloat16> {
  static constexpr bool bf16 = true;
};
template <>
struct Ty<__half> {
  static constexpr bool bf16 = false;
};

// S (64 x 64, f32) = (accumulate ? S : 0) + A B^T: A from shared memory (K-major, desc_a), B from
// shared memory (K-major, desc_b), no transposes.
template <typename T>
__device__ __forceinline__ void mma_ss_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (Ty<T>::bf16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MS_R32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : MS_ACC32
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " MS_R32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : MS_ACC32
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// O (64 x N, f32) += A B: A (64 x 16) from registers (a[4], the accumulator-shaped fragment), B
// (16 x N) from shared memory, MN-major (transpose bit 1). N = 64 or 128.
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "m64n64k16 or m64n128k16");
  if constexpr (N == 64) {
    if constexpr (Ty<T>::bf16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MS_R32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
          : MS_ACC32
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " MS_R32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
          : MS_ACC32
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    }
  } else {
    if constexpr (Ty<T>::bf16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MS_R64
          ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
          : MS_ACC64
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " MS_R64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
          : MS_ACC64
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    }
  }
}

#undef MS_ACC8
#undef MS_ACC32
#undef MS_ACC64
#undef MS_R32
#undef MS_R64

}  // namespace minisched::cuda::wgmma
