// The one switch from a micro-kernel block's run-time row count to the template that computes it
// (gguf_linear's AVX2 kernel, gguf_microkernel.h, and its AVX-512 one, gguf_linear_avx512.cpp). A plain
// template with no vector code: included before a variant's pragma, so the code it calls is the variant's.
#pragma once

#include <cstdint>

namespace minisched::cpu {

// f.template operator()<MT>() for a block of mt rows, 1 <= mt <= 8 (a larger mt is a caller bug: 8).
template <typename F>
inline void with_rows(int64_t mt, F&& f) {
  switch (mt) {
    case 1:
      return f.template operator()<1>();
    case 2:
      return f.template operator()<2>();
    case 3:
      return f.template operator()<3>();
    case 4:
      return f.template operator()<4>();
    case 5:
      return f.template operator()<5>();
    case 6:
      return f.template operator()<6>();
    case 7:
      return f.template operator()<7>();
    default:
      return f.template operator()<8>();
  }
}

}  // namespace minisched::cpu
