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
  // sub-blocks' sc_j xd_j (and the mins' m_j xd_j) as floats. The codes are unpacked once for the MB input rows.
  template <bool FIVE, int MB>
  static void k_quant(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), zero = _mm256_setzero_si256();
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += FIVE ? 176 : 144) {
      prefetch_ahead(w, FIVE ? 176 : 144);
      alignas(16) uint8_t sc[8], mn[8];
      scales_and_mins(w + 4, sc, mn);
      const uint8_t* qs = w + (FIVE ? 48 : 16);
      __m256i qh;
      if constexpr (FIVE) qh = load(w + 16);
      __m256i codes[8];  // sub-block j's 32 codes
      for (int c = 0; c < 4; ++c) {
        const __m256i q = load(qs + 32 * c);
        codes[2 * c] = _mm256_and_si256(q, low4);
        codes[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if constexpr (FIVE) {  // bit 2c of qh[l] to value l of sub-block 2c, bit 2c + 1 to sub-block 2c + 1
          const __m256i bits = _mm256_srli_epi16(qh, 2 * c);
          codes[2 * c] = _mm256_or_si256(codes[2 * c], _mm256_and_si256(_mm256_slli_epi16(bits, 4), bit4));
          codes[2 * c + 1] = _mm256_or_si256(codes[2 * c + 1], _mm256_and_si256(_mm256_slli_epi16(bits, 3), bit4));
        }
      }
      const __m256 block_scales = bytes_as_floats(sc), block_mins = bytes_as_floats(mn);
      const __m256 d = _mm256_set1_ps(half_at(w)), dmin = _mm256_set1_ps(half_at(w + 2));
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.xq[m] + 256 * b;
        __m256i dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = Sums::bytes(zero, codes[j], load(xq + 32 * j));
        const __m256 steps = _mm256_loadu_ps(x.xd[m] + 8 * b);
        const __m256 scales = _mm256_mul_ps(_mm256_mul_ps(block_scales, steps), d);
        const __m256 mins = _mm256_mul_ps(_mm256_mul_ps(block_mins, steps), dmin);
        // each sub-block's sum of input codes: two sums of 16
        const __m256i code_sums = _mm256_madd_epi16(load(x.sums[m] + 16 * b), _mm256_set1_epi16(1));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums_of_8(dots)), scales, acc[m]);
        acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(code_sums), mins, acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[m] = sum8(acc[m]);
  }

  // Each 32 values' products (two groups of 16) scaled by their groups' sc_g in integers, the codes' offset of 32
  // taken away (32 sum_g sc_g sum(xq of g)), and each sub-block of 32 scaled by its xd_j as floats.
  template <int MB>
  static void q6_k(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += 210) {
      prefetch_ahead(w, 210);
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      __m256i codes[8], group_scales[8];  // sub-block j's 32 codes, and its two groups' scales (16 lanes each)
      for (int h = 0; h < 2; ++h) {
        const __m256i ql[2] = {load(w + 64 * h), load(w + 64 * h + 32)}, qh = load(w + 128 + 32 * h);
        for (int s = 0; s < 4; ++s) {
          const __m256i low = s < 2 ? _mm256_and_si256(ql[s], low4) : _mm256_and_si256(_mm256_srli_epi16(ql[s - 2], 4), low4);
          const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * s), 4), high2);
          codes[4 * h + s] = _mm256_or_si256(low, high);
          const int g = 8 * h + 2 * s;  // the 16-value groups of the step's two 128-bit halves
          group_scales[4 * h + s] = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        }
      }
      const __m256 d = _mm256_set1_ps(half_at(w + 208));
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.xq[m] + 256 * b;
        // lane j: 32 sum_g sc_g sum(xq of group g) over sub-block j's two groups
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(load(x.sums[m] + 16 * b), scales), 5);
        __m256i dots[8];
        for (int j = 0; j < 8; ++j)
          dots[j] = Sums::scaled(_mm256_setzero_si256(), _mm256_maddubs_epi16(codes[j], load(xq + 32 * j)),
                                 group_scales[j]);
        const __m256 steps = _mm256_mul_ps(_mm256_loadu_ps(x.xd[m] + 8 * b), d);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums_of_8(dots), offset)), steps, acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[m] = sum8(acc[m]);
  }

  template <int MB>
  static void q8_0(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += 34) {
      prefetch_ahead(w, 34);
      const __m256i q = load(w + 2), magnitude = _mm256_abs_epi8(q);  // signed codes: |q| times xq with q's sign
      const float d = half_at(w);
      for (int m = 0; m < MB; ++m) {
        const __m256i p = Sums::bytes(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(load(x.xq[m] + 32 * b), q));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x.xd[m][b]), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[m] = sum8(acc[m]);
  }
};

}  // namespace minimlx_native
