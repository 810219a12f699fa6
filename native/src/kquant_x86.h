// The block products of kquant.h on 256-bit integer vectors, shared by the AVX2 and AVX-512 VNNI files. `Sums`
// supplies the two integer steps each instruction set does its own way:
//
//   bytes(acc, u, s)      acc + the sums of four u8 x s8 products in each 32-bit lane (vpdpbusd; maddubs + madd)
//   scaled(acc, p, s)     acc + the sums of two int16 products p * s in each 32-bit lane (vpdpwssd; madd + add)
//
// Codes of Q4_K, Q5_K and Q6_K are unsigned (0..15, 0..31, 0..63) and meet the signed input codes in maddubs, whose
// pairs fit 16 bits (at most 2 * 63 * 127); each pair sum is then multiplied by its sub-block's scale in `scaled`.
#pragma once

#include <immintrin.h>

#include "kquant.h"

namespace minimlx_native {

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lane j of the result: the sum of the 8 lanes of v[j].
inline __m256i sums_of_8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

inline __m256 bytes_as_floats(const uint8_t* p) {  // 8 unsigned bytes
  uint64_t bytes;
  std::memcpy(&bytes, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
}

template <class Sums>
struct X86BlockDot {
  static __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

  // Each sub-block's integer sum in a vector of its own, then the eight summed across lanes into one, scaled by the
  // sub-blocks' sc_j xd_j (and the mins' m_j xd_j) as floats.
  template <bool FIVE>
  static float k_quant(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* sums, int blocks) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), zero = _mm256_setzero_si256();
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += FIVE ? 176 : 144, xq += 256, xd += 8, sums += 16) {
      alignas(16) uint8_t sc[8], mn[8];
      scales_and_mins(w + 4, sc, mn);
      const uint8_t* qs = w + (FIVE ? 48 : 16);
      __m256i qh;
      if constexpr (FIVE) qh = load(w + 16);
      __m256i dots[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i q = load(qs + 32 * c);
        __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if constexpr (FIVE) {  // bit 2c of qh[l] to value l of sub-block 2c, bit 2c + 1 to sub-block 2c + 1
          const __m256i bits = _mm256_srli_epi16(qh, 2 * c);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(bits, 4), bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(bits, 3), bit4));
        }
        dots[2 * c] = Sums::bytes(zero, lo, load(xq + 64 * c));
        dots[2 * c + 1] = Sums::bytes(zero, hi, load(xq + 64 * c + 32));
      }
      const __m256 steps = _mm256_loadu_ps(xd);
      const __m256 scales = _mm256_mul_ps(_mm256_mul_ps(bytes_as_floats(sc), steps), _mm256_set1_ps(half_at(w)));
      const __m256 mins = _mm256_mul_ps(_mm256_mul_ps(bytes_as_floats(mn), steps), _mm256_set1_ps(half_at(w + 2)));
      // each sub-block's sum of input codes: two sums of 16
      const __m256i code_sums = _mm256_madd_epi16(load(sums), _mm256_set1_epi16(1));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_of_8(dots)), scales, acc);
      acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(code_sums), mins, acc);
    }
    return sum8(acc);
  }

  // Each 32 values' products (two groups of 16) scaled by their groups' sc_g in integers, the 32 codes' offset of
  // 32 taken away (32 sum_g sc_g sum(xq of g)), and each sub-block of 32 scaled by its xd_j as floats.
  static float q6_k(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* sums, int blocks) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += 210, xq += 256, xd += 8, sums += 16) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(load(sums), scales), 5);  // lane j: sub-block j's
      __m256i dots[8];
      for (int h = 0; h < 2; ++h) {
        const __m256i ql[2] = {load(w + 64 * h), load(w + 64 * h + 32)}, qh = load(w + 128 + 32 * h);
        for (int s = 0; s < 4; ++s) {
          const __m256i low = s < 2 ? _mm256_and_si256(ql[s], low4) : _mm256_and_si256(_mm256_srli_epi16(ql[s - 2], 4), low4);
          const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * s), 4), high2);
          const __m256i p = _mm256_maddubs_epi16(_mm256_or_si256(low, high), load(xq + 128 * h + 32 * s));
          const int g = 8 * h + 2 * s;  // the 16-value groups of the step's two 128-bit halves
          dots[4 * h + s] = Sums::scaled(_mm256_setzero_si256(), p,
                                         _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g])));
        }
      }
      const __m256 steps = _mm256_mul_ps(_mm256_loadu_ps(xd), _mm256_set1_ps(half_at(w + 208)));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums_of_8(dots), offset)), steps, acc);
    }
    return sum8(acc);
  }

  static float q8_0(const uint8_t* w, const int8_t* xq, const float* xd, int blocks) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += 34, xq += 32) {
      const __m256i q = load(w + 2);  // signed codes: |q| times xq with q's sign
      const __m256i p = Sums::bytes(_mm256_setzero_si256(), _mm256_abs_epi8(q), _mm256_sign_epi8(load(xq), q));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half_at(w) * xd[b]), acc);
    }
    return sum8(acc);
  }
};

}  // namespace minimlx_native
