// CPU feature detection (cpuid + XCR0 + Linux's AMX permission) and the active kernel variant;
// see cpu_isa.h.
#include "cpu/cpu_isa.h"

#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace minisched::cpu {
namespace {

#if defined(__x86_64__)
struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

bool bit(unsigned v, int i) { return (v >> i) & 1u; }

// Linux (5.16+) gives a process AMX tile data only on request; without it the first tile
// instruction faults (SIGILL), whatever cpuid says.
bool request_amx(std::string* why) {
#if defined(__linux__)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    *why = "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed (kernel without AMX support, or denied)";
    return false;
  }
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) != 0 || !((mask >> kXfeatureXtiledata) & 1)) {
    *why = "arch_prctl(ARCH_GET_XCOMP_PERM) does not list XTILEDATA";
    return false;
  }
  return true;
#else
  *why = "AMX permission is requested on Linux only";
  return false;
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  f.x86 = true;
  const Regs v = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor, &v.b, 4);
  std::memcpy(vendor + 4, &v.d, 4);
  std::memcpy(vendor + 8, &v.c, 4);
  f.vendor = vendor;
  if (cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i, &r, 16);
    }
    f.model = brand;
    const auto first = f.model.find_first_not_of(' ');
    f.model = first == std::string::npos ? "" : f.model.substr(first);
  }
  const unsigned max_leaf = v.a;
  const Regs l1 = cpuid(1);
  const bool osxsave = bit(l1.c, 27);
  f.fma = bit(l1.c, 12);
  f.f16c = bit(l1.c, 29);
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  f.os_ymm = (xcr0 & 0x6) == 0x6;
  f.os_zmm = f.os_ymm && (xcr0 & 0xE0) == 0xE0;
  if (max_leaf >= 7) {
    const Regs l7 = cpuid(7, 0);
    f.avx2 = bit(l7.b, 5);
    f.avx512f = bit(l7.b, 16);
    f.avx512dq = bit(l7.b, 17);
    f.avx512bw = bit(l7.b, 30);
    f.avx512vl = bit(l7.b, 31);
    f.avx512_vnni = bit(l7.c, 11);
    f.avx512_fp16 = bit(l7.d, 23);
    f.amx_bf16 = bit(l7.d, 22);
    f.amx_tile = bit(l7.d, 24);
    f.amx_int8 = bit(l7.d, 25);
    if (l7.a >= 1) {
      const Regs l71 = cpuid(7, 1);
      f.avx_vnni = bit(l71.a, 4);
      f.avx512_bf16 = bit(l71.a, 5);
    }
  }
  if (f.amx_tile) {
    if ((xcr0 & (3ull << 17)) != (3ull << 17))
      f.amx_error = "XCR0 does not enable the tile state";
    else
      f.os_amx = request_amx(&f.amx_error);
  }
#endif
  return f;
}

std::atomic<int> g_isa{-1};  // -1: not chosen yet (best_isa() on first use)

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx2Vnni:
      return "avx2-vnni";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAmx:
      return "amx";
  }
  return "?";
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  if (!f.x86) return false;
  const bool avx2 = f.avx2 && f.fma && f.f16c && f.os_ymm;
  switch (isa) {
    case Isa::kAvx2:
      return true;  // the build's baseline: a machine without it could not have loaded the extension
    case Isa::kAvx2Vnni:
      return avx2 && f.avx_vnni;
    case Isa::kAvx512:
      return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512_vnni && f.os_zmm;
    case Isa::kAmx:  // the kernels also use AVX512-BF16 (vcvtne2ps2bf16), which every AMX CPU has
      return isa_supported(Isa::kAvx512) && f.avx512_bf16 && f.amx_tile && f.amx_int8 && f.amx_bf16 && f.os_amx;
  }
  return false;
}

Isa best_isa() {
  static const Isa best = [] {
    Isa b = Isa::kAvx2;
    for (int i = 0; i < kNumIsas; ++i)
      if (isa_supported(static_cast<Isa>(i))) b = static_cast<Isa>(i);
    return b;
  }();
  return best;
}

Isa isa() {
  const int v = g_isa.load(std::memory_order_relaxed);
  return v < 0 ? best_isa() : static_cast<Isa>(v);
}

void set_isa(Isa isa) {
  if (isa_supported(isa)) g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace minisched::cpu
