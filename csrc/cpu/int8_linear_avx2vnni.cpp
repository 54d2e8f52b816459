// The AVX-VNNI variant of int8_linear's micro-kernel: int8_microkernel.h with vpdpwssd on ymm (one
// instruction for vpmaddwd + vpaddd), compiled for AVX-VNNI by the pragma below, after every header
// the micro-kernel needs (cpu_isa.h says why).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/isa_kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")

#include "cpu/int8_microkernel.h"

namespace minisched::cpu::avx2vnni {

void int8_panel_rows(const int16_t* q, int64_t M, int64_t ldq, const float* sx, const int8_t* w, const float* ws,
                     int64_t np_here, int64_t K, int64_t G, float* out, int64_t ldo, int64_t ncols) {
  int8k::panel_rows<true>(q, M, ldq, sx, w, ws, np_here, K, G, out, ldo, ncols);
}

}  // namespace minisched::cpu::avx2vnni

#pragma GCC pop_options
#else  // not x86: never called
void minisched::cpu::avx2vnni::int8_panel_rows(const int16_t*, int64_t, int64_t, const float*, const int8_t*,
                                               const float*, int64_t, int64_t, int64_t, float*, int64_t, int64_t) {
  __builtin_trap();
}
#endif
