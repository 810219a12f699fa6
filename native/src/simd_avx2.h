// AVX2 + FMA + F16C vectors of 8 floats, for the files compiled for it (kernel_avx2.cpp, kernel_avxvnni.cpp).
#pragma once

#include <immintrin.h>

#include "kernel.h"

namespace minimlx_native {

struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int registers = 16;  // vector registers (ymm0-15)
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // out[r] = the sum of v[r]'s lanes, r < 4: sums within each 128-bit lane, then across the two.
  static void sum4(const V* v, float* out) {
    const V ab = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const V cd = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    const V abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static void unpack4(const uint8_t* p, V* q) {
    const __m256i mask = _mm256_set1_epi32(0xF);
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  }
  static void unpack8(const uint8_t* p, V* q) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
};

// The codes of a step of 32 values as 32 unsigned bytes in order, for the integer products (integer.h). A 4-bit
// byte holds values 2i (low nibble) and 2i + 1: widened to 16 bits and or-ed with itself shifted by 4, its low
// nibble stays in the low byte and its high nibble lands in the high byte.
struct Avx2Codes {
  static constexpr int span = 32;
  using Codes = __m256i;
  template <int BITS>
  static Codes codes(const uint8_t* p) {
    if constexpr (BITS == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_or_si256(bytes, _mm256_slli_epi16(bytes, 4)), _mm256_set1_epi16(0x0F0F));
  }
  static __m256 spread(const float* s) { return _mm256_set1_ps(s[0]); }
};

}  // namespace minimlx_native
