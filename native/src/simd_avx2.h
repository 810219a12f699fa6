// AVX2 + FMA + F16C vectors of 8 floats, for the files compiled for it (kernel_avx2.cpp, kernel_avxvnni.cpp).
#pragma once

#include <immintrin.h>

#include "kernel.h"
#include "simd_x86.h"

namespace minimlx_native {

struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int registers = 16;  // vector registers (ymm0-15)
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
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

// The codes of a step for the integer products (integer.h): one load of 32 bytes, 64 4-bit values (two blocks, four
// lanes each: the low nibbles, then the high ones, each a vector of codes) or 32 8-bit ones (one block).
struct Avx2Codes {
  template <int BITS>
  static constexpr int span = BITS == 4 ? 64 : 32;
  struct Codes {
    __m256i low, high;  // 8-bit codes: `low`
  };
  template <int BITS>
  static Codes split(__m256i bytes) {
    if constexpr (BITS == 8) return {bytes, bytes};
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(bytes, nibble), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
  }
  template <int BITS>
  static Codes codes(const uint8_t* p) {
    return split<BITS>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // The one partial step: a row of 4-bit codes whose last 32 values fill half a step (16 bytes).
  template <int BITS>
  static Codes partial(const uint8_t* p, int) {
    return split<BITS>(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  template <int N, class S>
  static __m256 spread(const S* s) {
    if constexpr (N == 1) return _mm256_set1_ps(static_cast<float>(*s));
    else return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(load_first<2>(s)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
  // The one partial step's: its first block's scale (the second block's codes are zeros).
  template <int N, class S>
  static __m256 spread(const S* s, int) {
    return _mm256_set1_ps(static_cast<float>(*s));
  }
};
}  // namespace minimlx_native
