// The AVX-VNNI variant of gguf_a8_linear's ymm micro-kernel: gguf_a8_microkernel.h with vpdpbusd on ymm
// (one instruction for vpmaddubsw + vpmaddwd + vpaddd), compiled for AVX-VNNI by the pragma below,
// after every header the micro-kernel needs (cpu_isa.h says why).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")

#include "cpu/gguf_a8_microkernel.h"

namespace minisched::cpu::avx2vnni {

void gguf_a8_panel_rows(int qtype, const A8Rows& a, int64_t M, const uint8_t* wp, int64_t np_here, int64_t KB,
                        float* out, int64_t ldo, int64_t ncols) {
  a8k::panel_rows<true>(qtype, a, M, wp, np_here, KB, out, ldo, ncols);
}

}  // namespace minisched::cpu::avx2vnni

#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx2vnni::gguf_a8_panel_rows(int, const A8Rows&, int64_t, const uint8_t*, int64_t, int64_t, float*,
                                                  int64_t, int64_t) {
  __builtin_trap();
}
#endif
