// The block products of kquant.h on 512-bit vectors with VNNI (vpdpbusd), for the AVX-512 VNNI file. A vector holds
// two sub-blocks of 32 codes, which Q4_K and Q5_K store in one 32-byte chunk (its low and its high nibbles) and Q6_K
// in one 64-byte load, and the input codes of two consecutive sub-blocks are one 64-byte load: a super-block of 256
// values is four vpdpbusd, whose 32-bit lanes (four products each, eight lanes a sub-block) are converted to floats
// and scaled lane by lane (each lane by its sub-block's, or Q6_K's 16-value group's, scale times its input block's
// step), so no sums across lanes are taken before the end of the row.
#pragma once

#include <immintrin.h>

#include "kquant_x86.h"

namespace minimlx_native {

// kquant_x86.h's integer steps with VNNI on 256-bit vectors (AVX-512 VL): vpdpbusd and vpdpwssd.
struct Avx512VnniSums {
  static __m256i bytes(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i scaled(__m256i acc, __m256i p, __m256i s) { return _mm256_dpwssd_epi32(acc, p, s); }
};

struct Avx512BlockDot {
  // Lane l of the result: lane l / 8 + 2c of the 8 floats v, for the pair of sub-blocks (2c, 2c + 1).
  static __m512 pair_lanes(__m256 v, int c) {
    const __m512i index = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                                               4, 3, 2, 1, 0), 3),
                                           _mm512_set1_epi32(2 * c));
    return _mm512_permutexvar_ps(index, _mm512_castps256_ps512(v));
  }
  // Lane l of the result: lane l / 4 + 4c of the 16 floats v, the 16-value groups of the pair of sub-blocks c.
  static __m512 group_lanes(__m512 v, int c) {
    const __m512i index = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                                               4, 3, 2, 1, 0), 2),
                                           _mm512_set1_epi32(4 * c));
    return _mm512_permutexvar_ps(index, v);
  }
  static __m512i two(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }

  // A Q4_K or Q5_K super-block's codes, codes[c] sub-blocks 2c and 2c + 1.
  template <bool FIVE>
  static void k_quant_codes(const uint8_t* w, __m512i* codes) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    const uint8_t* qs = w + (FIVE ? 48 : 16);
    __m512i qh;
    if constexpr (FIVE) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
      qh = two(bits, _mm256_srli_epi16(bits, 1));  // bit 2c of each half: sub-block 2c's, then 2c + 1's
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      codes[c] = _mm512_and_si512(two(q, _mm256_srli_epi16(q, 4)), low4);
      if constexpr (FIVE)
        codes[c] = _mm512_or_si512(codes[c], _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(qh, 2 * c), 4), bit4));
    }
  }

  // A Q6_K super-block's codes (0..63, the offset of 32 not taken), codes[c] sub-blocks 2c and 2c + 1.
  static void q6_k_codes(const uint8_t* w, __m512i* codes) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(w + 64 * h);
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
      const __m512i qh = two(bits, _mm256_srli_epi16(bits, 2));
      codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), high2));
      codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(qh, high2));
    }
  }

  // The 16 codes at bytes [16 i, 16 i + 16) of v as floats.
  static __m512 code_floats(__m512i v, int i) {
    __m128i part;
    switch (i) {
      case 0: part = _mm512_extracti32x4_epi32(v, 0); break;
      case 1: part = _mm512_extracti32x4_epi32(v, 1); break;
      case 2: part = _mm512_extracti32x4_epi32(v, 2); break;
      default: part = _mm512_extracti32x4_epi32(v, 3); break;
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part));
  }

  // One row of K values of `type` dequantized to float32, as kquant.h's dequantize_blocks gives them (Q8_0 there):
  // the same roundings (a product, then the min taken away), so gguf's values exactly.
  static void dequantize(int type, const uint8_t* row, int K, float* out) {
    if (type == static_cast<int>(Blocks::q8_0)) return dequantize_blocks(type, row, K, out);
    const int bytes = block_bytes(type);
    for (int b = 0; b < K / 256; ++b, row += bytes, out += 256) {
      __m512i codes[4];
      if (type == static_cast<int>(Blocks::q6_k)) {
        q6_k_codes(row, codes);
        const float d = half_at(row + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            const __m512 q = _mm512_sub_ps(code_floats(codes[c], i), _mm512_set1_ps(32.0f));
            _mm512_storeu_ps(out + 64 * c + 16 * i, _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(sc[4 * c + i])), q));
          }
        continue;
      }
      if (type == static_cast<int>(Blocks::q5_k)) k_quant_codes<true>(row, codes);
      else k_quant_codes<false>(row, codes);
      uint8_t sc[8], mn[8];
      scales_and_mins(row + 4, sc, mn);
      const float d = half_at(row), dmin = half_at(row + 2);
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 4; ++i) {
          const int j = 2 * c + i / 2;
          const __m512 scale = _mm512_set1_ps(d * sc[j]), min = _mm512_set1_ps(dmin * mn[j]);
          _mm512_storeu_ps(out + 64 * c + 16 * i, _mm512_sub_ps(_mm512_mul_ps(scale, code_floats(codes[c], i)), min));
        }
    }
  }

  template <bool FIVE, int MB>
  static void k_quant(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    __m512 acc[MB];
    __m256 mins_acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps(), mins_acc[m] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += FIVE ? 176 : 144) {
      alignas(16) uint8_t sc[8], mn[8];
      scales_and_mins(w + 4, sc, mn);
      __m512i codes[4];  // sub-blocks 2c and 2c + 1
      k_quant_codes<FIVE>(w, codes);
      const __m256 scales = _mm256_mul_ps(bytes_as_floats(sc), _mm256_set1_ps(half_at(w)));
      const __m256 mins = _mm256_mul_ps(bytes_as_floats(mn), _mm256_set1_ps(half_at(w + 2)));
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.xq[m] + 256 * b;
        const __m256 steps = _mm256_loadu_ps(x.xd[m] + 8 * b), lane_scales = _mm256_mul_ps(scales, steps);
        for (int c = 0; c < 4; ++c) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], _mm512_loadu_si512(xq + 64 * c));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), pair_lanes(lane_scales, c), acc[m]);
        }
        const __m256i code_sums = _mm256_madd_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums[m] + 16 * b)), _mm256_set1_epi16(1));
        mins_acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code_sums), _mm256_mul_ps(mins, steps), mins_acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]) - sum8(mins_acc[m]);
  }

  // Q6_K: sub-blocks 4h + s and 4h + s + 1 (s = 0, 2) have their low bits in the low (s = 0) or high (s = 2) nibbles
  // of the half's 64 bytes of ql, their high bits at bits 2s, 2s + 2 of qh; each lane is scaled by its 16-value
  // group's sc_g d times its sub-block's step, and the codes' offset of 32 taken away as 32 sum_g sc_g d xd sum(xq).
  template <int MB>
  static void q6_k(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    const __m512i group_steps = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                   1, 0), 1);  // group g's sub-block: g / 2
    __m512 acc[MB], offsets[MB];
    for (int m = 0; m < MB; ++m) acc[m] = offsets[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += 210) {
      const __m512 group_scales = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)))),
          _mm512_set1_ps(half_at(w + 208)));
      __m512i codes[4];  // sub-blocks (0, 1), (2, 3), (4, 5), (6, 7)
      q6_k_codes(w, codes);
      __m512 lane_scales[4];
      for (int c = 0; c < 4; ++c) lane_scales[c] = group_lanes(group_scales, c);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.xq[m] + 256 * b;
        const __m256 steps = _mm256_loadu_ps(x.xd[m] + 8 * b);
        for (int c = 0; c < 4; ++c) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], _mm512_loadu_si512(xq + 64 * c));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(lane_scales[c], pair_lanes(steps, c)),
                                   acc[m]);
        }
        const __m512 sums = _mm512_cvtepi32_ps(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums[m] + 16 * b))));
        const __m512 group_steps_m = _mm512_permutexvar_ps(group_steps, _mm512_castps256_ps512(steps));
        offsets[m] = _mm512_fmadd_ps(sums, _mm512_mul_ps(group_scales, group_steps_m), offsets[m]);
      }
    }
    for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]) - 32.0f * _mm512_reduce_add_ps(offsets[m]);
  }

  template <int MB>
  static void q8_0(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    X86BlockDot<Avx512VnniSums>::template q8_0<MB>(w, x, blocks, out);
  }
};

}  // namespace minimlx_native
