// AVX-512 (F + BW) vectors of 16 floats, for the files compiled for it (kernel_avx512.cpp, kernel_avx512vnni.cpp).
#pragma once

#include <immintrin.h>

#include "kernel.h"

namespace minimlx_native {

struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int registers = 32;  // vector registers (zmm0-31)
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // out[r] = the sum of v[r]'s lanes, r < 4: sums within each 128-bit lane, then across the lanes.
  static void sum4(const V* v, float* out) {
    const V ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const V cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    const V abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  }
  static void unpack4(const uint8_t* p, V* q) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
  static void unpack8(const uint8_t* p, V* q) {
    for (int i = 0; i < 2; ++i)
      q[i] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
  }
};

}  // namespace minimlx_native
