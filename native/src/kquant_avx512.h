// The block products of kquant.h on 512-bit vectors with VNNI (vpdpbusd), for the AVX-512 VNNI file. A super-block of
// 256 values is four vpdpbusd of 64 codes against 64 input codes, whose 32-bit lanes (four products each) are
// converted to floats and scaled lane by lane (by the weights' scale times the input block's step), so no sums across
// lanes are taken before the end of the row. Q6_K's vectors hold two sub-blocks of 32 (one 64-byte load of its low
// bits); Q4_K's and Q5_K's take the inputs in interleave_by_16's order, where each 128-bit lane of two of the four
// vectors meets one sub-block, so those two accumulate in integers and are scaled once.
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

  // A Q4_K or Q5_K block's eight scales sc_j (bytes 0..7) and eight mins m_j (bytes 8..15) from its 12 packed bytes at
  // p (16 readable): bytes j, j + 4 (j < 4) hold sc_j, m_j in their low 6 bits; for j >= 4, byte j + 4 holds their low
  // 4 bits (low nibble sc_j, high m_j), the top 2 bits of bytes j - 4 and j their high 2.
  static __m128i scale_bytes(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i high = _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low6_or_4 = _mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i low_bits = _mm_blend_epi32(low6_or_4, _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15)), 8);
    return _mm_or_si128(low_bits, _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(0x30)));
  }

  // Q4_K and Q5_K against inputs ordered by interleave_by_16: the block's two 64-byte halves of codes give, by one
  // 128-bit lane shuffle each way, vector v (v < 2: low nibbles, else high ones) whose lane k holds values 16 (v % 2)
  // .. + 15 of sub-block 2k + v / 2, the same sub-block in every lane of vectors 0 and 1 (and of 2 and 3); so their two
  // vpdpbusd accumulate in one register, converted and scaled lane by lane once (by sc_j d xd_j) for each pair. The
  // mins' term takes sum_j m_j dmin xd_j sum(xq of j) from the inputs' super-block steps.
  template <bool FIVE, int MB>
  static void k_quant(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i halves = _mm512_srli_epi32(lanes, 3);                               // lane l: l / 8
    const __m512i even = _mm512_slli_epi32(_mm512_srli_epi32(lanes, 2), 1);           // lane l: 2 (l / 4)
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));                 // lane l: 2 (l / 4) + 1
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MB][2], mins[MB];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = mins[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += FIVE ? 176 : 144) {
      prefetch_ahead(w, FIVE ? 176 : 144);
      uint32_t d_dmin;
      std::memcpy(&d_dmin, w, 4);
      const __m512 d = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d_dmin)))));
      // lanes 0..7: sc_j d, lanes 8..15: m_j dmin
      const __m512 scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale_bytes(w + 4))), d);
      const uint8_t* qs = w + (FIVE ? 48 : 16);
      const __m512i first = _mm512_loadu_si512(qs), second = _mm512_loadu_si512(qs + 64);
      const __m512i lows = _mm512_shuffle_i64x2(first, second, 0x88), highs = _mm512_shuffle_i64x2(first, second, 0xDD);
      __m512i codes[4] = {_mm512_and_si512(lows, low4), _mm512_and_si512(highs, low4),
                          _mm512_and_si512(_mm512_srli_epi16(lows, 4), low4),
                          _mm512_and_si512(_mm512_srli_epi16(highs, 4), low4)};
      if constexpr (FIVE) {  // bit 2k (2k + 1) of qh[l] is the fifth bit of value l of sub-block 2k (2k + 1)
        const __m512i bit4 = _mm512_set1_epi8(0x10), shifts = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0);
        for (int v = 0; v < 2; ++v) {
          const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 + 16 * v));
          const __m512i qh = _mm512_srlv_epi64(_mm512_broadcast_i32x4(bits), shifts);
          codes[v] = _mm512_or_si512(codes[v], _mm512_and_si512(_mm512_slli_epi64(qh, 4), bit4));
          codes[2 + v] = _mm512_or_si512(codes[2 + v], _mm512_and_si512(_mm512_slli_epi64(qh, 3), bit4));
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.interleaved[m] + 256 * b;
        const __m512 lane_scales = _mm512_mul_ps(scales, _mm512_loadu_ps(x.steps[m] + 16 * b));
        mins[m] = _mm512_add_ps(mins[m], lane_scales);  // lanes 8..15
        const __m512i zero = _mm512_setzero_si512();
        const __m512i even_dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, codes[0], _mm512_loadu_si512(xq)),
                                                      codes[1], _mm512_loadu_si512(xq + 64));
        const __m512i odd_dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, codes[2], _mm512_loadu_si512(xq + 128)),
                                                     codes[3], _mm512_loadu_si512(xq + 192));
        acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even_dots), _mm512_permutexvar_ps(even, lane_scales), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd_dots), _mm512_permutexvar_ps(odd, lane_scales), acc[m][1]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 min_terms = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(mins[m]), 1));
      out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - sum8(min_terms);
    }
  }

  // Q6_K: sub-blocks 4h + s and 4h + s + 1 (s = 0, 2) have their low bits in the low (s = 0) or high (s = 2) nibbles
  // of the half's 64 bytes of ql, their high bits at bits 2s, 2s + 2 of qh; each lane is scaled by its 16-value
  // group's sc_g d times its sub-block's step, and the codes' offset of 32 taken away as 32 sum_g sc_g d xd sum(xq).
  template <int MB>
  static void q6_k(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    const __m512i group_steps = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                   1, 0), 1);  // group g's sub-block: g / 2
    __m512 acc[MB][2], offsets[MB];  // two sums of the chunks (c even, odd), so that each waits on half the fmas
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = offsets[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b, w += 210) {
      prefetch_ahead(w, 210);
      const __m512 group_scales = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)))),
          _mm512_set1_ps(half_at(w + 208)));
      __m512i codes[4];  // sub-blocks (0, 1), (2, 3), (4, 5), (6, 7)
      q6_k_codes(w, codes);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.xq[m] + 256 * b;
        const __m512 steps = _mm512_castps256_ps512(_mm256_loadu_ps(x.xd[m] + 8 * b));
        // lane g: sc_g d times the step of group g's sub-block
        const __m512 scales = _mm512_mul_ps(group_scales, _mm512_permutexvar_ps(group_steps, steps));
        for (int c = 0; c < 4; ++c) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], _mm512_loadu_si512(xq + 64 * c));
          acc[m][c % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), group_lanes(scales, c), acc[m][c % 2]);
        }
        const __m512 sums = _mm512_cvtepi32_ps(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums[m] + 16 * b))));
        offsets[m] = _mm512_fmadd_ps(sums, scales, offsets[m]);
      }
    }
    for (int m = 0; m < MB; ++m)
      out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - 32.0f * _mm512_reduce_add_ps(offsets[m]);
  }

  template <int MB>
  static void q8_0(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    X86BlockDot<Avx512VnniSums>::template q8_0<MB>(w, x, blocks, out);
  }
};

}  // namespace minimlx_native
