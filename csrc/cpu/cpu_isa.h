// Run-time ISA dispatch of the CPU kernels: what the machine can run, detected once at load from
// cpuid and the OS's XSAVE state, and which variant the kernels use now (the best supported one
// unless overridden through minisched.ops.set_cpu_isa, for tests and benchmarks).
//
// The whole extension is compiled for x86-64-v3 (AVX2 + FMA), the portable baseline. Faster
// variants live in their own translation units (csrc/cpu/*_avx512.cpp), compiled for their ISA
// with `#pragma GCC target` after every header is included: nothing from ATen or the standard
// library is instantiated there, so no inline function compiled with AVX-512 can be picked by the
// linker for code that runs on an AVX2 machine. Those files expose plain functions on raw
// pointers, declared in isa_kernels.h without any attribute (GCC would read a `target` attribute
// on a C++ declaration as function multi-versioning and mangle the definition as a clone); the
// ATen glue in <op>.cpp checks the inputs, splits the work over threads and calls the variant
// that isa() names.
//
// Variants, each a superset of the one before it in what the kernels use:
//   avx2       AVX2 + FMA (+ F16C): every x86-64-v3 machine
//   avx2-vnni  + AVX-VNNI (int16/int8 dot products on ymm: Alder Lake, Sapphire Rapids, Zen 5)
//   avx512     AVX-512 F/BW/VL/DQ + AVX512-VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4/5)
//   amx        + AMX-TILE/INT8/BF16 and Linux's permission for the tile data (Sapphire Rapids on):
//              tile kernels for the int8 and bf16 linears from 16 rows on (*_amx.cpp)
// The OS must have enabled the register state: XCR0's YMM bits for AVX2, its opmask/ZMM bits for
// AVX-512 (a kernel or hypervisor can switch them off while cpuid still lists the instructions).
// AMX needs, besides cpuid and XCR0's tile bits, Linux's permission for the tile data, requested at
// load (cpu_isa.cpp); without it the first tile instruction faults.
#pragma once

#include <cstdint>
#include <string>

namespace minisched::cpu {

enum class Isa : int { kAvx2 = 0, kAvx2Vnni = 1, kAvx512 = 2, kAmx = 3 };
constexpr int kNumIsas = 4;

const char* isa_name(Isa isa);

struct CpuFeatures {
  bool x86 = false;
  bool avx2 = false, fma = false, f16c = false;
  bool avx_vnni = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_fp16 = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool os_ymm = false;    // XCR0: SSE + AVX state
  bool os_zmm = false;    // XCR0: opmask + ZMM_Hi256 + Hi16_ZMM state
  bool os_amx = false;    // XCR0: XTILECFG + XTILEDATA, and Linux granted XTILEDATA
  std::string amx_error;  // why AMX is not usable, when cpuid lists it
  std::string vendor, model;
};

// Detected once (thread-safe static).
const CpuFeatures& cpu_features();
bool isa_supported(Isa isa);
Isa best_isa();

// The variant the kernels use now: best_isa() unless set_isa() chose another (supported) one.
Isa isa();
void set_isa(Isa isa);  // TORCH_CHECK-free: the Python binding validates; an unsupported one is ignored

inline bool use_avx512() { return isa() >= Isa::kAvx512; }

}  // namespace minisched::cpu
