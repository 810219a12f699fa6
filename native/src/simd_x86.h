// 128-bit helpers shared by the x86-64 files (all compiled with F16C: every CPU with AVX2 or AVX-512 has it).
#pragma once

#include <immintrin.h>

#include <cstring>

#include "kernel.h"

namespace minimlx_native {

// The N (1, 2 or 4) values from p as floats in the low lanes of a 128-bit vector, reading no further than them.
template <int N>
inline __m128 load_first(const float* p) {
  if constexpr (N == 4) return _mm_loadu_ps(p);
  if constexpr (N == 2) return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
  return _mm_load_ss(p);
}

template <int N>
inline __m128 load_first(const Half* p) {
  if constexpr (N == 4) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  int32_t bits = 0;
  std::memcpy(&bits, p, N * sizeof(Half));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

}  // namespace minimlx_native
