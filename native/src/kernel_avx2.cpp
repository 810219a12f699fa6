// AVX2 + FMA + F16C: 8 floats per vector. Compiled with -mavx2 -mfma -mf16c; called only when the CPU has them.
#include "attention.h"
#include "delta.h"
#include "gemm.h"
#include "integer.h"
#include "kquant_x86.h"
#include "rows.h"
#include "simd_avx2.h"

namespace minimlx_native {

// The integer step with maddubs (u8 x s8 products summed in pairs to 16 bits, then in fours to 32). Pairs of
// 8-bit codes (up to 2 * 255 * 127) would overflow 16 bits, so those enter recentred, q - 128, as signed bytes:
// |q - 128| times xq with q - 128's sign (at most 2 * 128 * 127). The low and high nibbles' pairs (each at most
// 2 * 15 * 127) are added in 16 bits before the widening.
struct Maddubs : Avx2Codes {
  template <int BITS>
  static constexpr int offset = BITS == 8 ? 128 : 0;
  template <int BITS>
  static __m256 dot(const Codes& codes, const int8_t* xq) {
    const __m256i* x = reinterpret_cast<const __m256i*>(xq);
    __m256i pairs;
    if constexpr (BITS == 8) {
      const __m256i centred = _mm256_xor_si256(codes.low, _mm256_set1_epi8(static_cast<char>(0x80)));
      pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(_mm256_loadu_si256(x), centred));
    } else {
      pairs = _mm256_add_epi16(_mm256_maddubs_epi16(codes.low, _mm256_loadu_si256(x)),
                               _mm256_maddubs_epi16(codes.high, _mm256_loadu_si256(x + 1)));
    }
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};

// One block of quantize_inputs in four vectors of 8 (the codes as scalar code rounds them: to nearest, even on ties),
// packed to bytes in order; the even and odd values' apart for nibble order.
struct Avx2Block {
  static float largest(const float* x) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  template <bool NIBBLES>
  static int quantize(const float* x, float& d, int8_t* first, int8_t* second) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    d = largest(x) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    // packs interleaves the 128-bit halves: bytes 0-3 8-11 16-19 24-27 4-7 ... in dwords; put them back in order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if constexpr (NIBBLES) {
      const __m256i split = _mm256_shuffle_epi8(  // each half: its even bytes, then its odd bytes
          bytes, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
                                  5, 7, 9, 11, 13, 15));
      const __m256i grouped = _mm256_permute4x64_epi64(split, 0xD8);  // even bytes of both halves, then odd
      _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(grouped));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm256_extracti128_si256(grouped, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(first), bytes);
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4E));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xB1));
    return _mm_cvtsi128_si32(total);
  }
};

void quantize_inputs_avx2(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                          const QuantizedInputs& out) {
  quantize_rows<Avx2Block>(x, M, K, group_size, span, lanes, nibbles, out);
}

void rows_avx2(const Problem& p, int row_begin, int row_end) { rows<Avx2>(p, row_begin, row_end); }

void integer_rows_avx2(const Problem& p, int row_begin, int row_end) {
  integer_rows<Avx2, Maddubs>(p, row_begin, row_end);
}

void attend_avx2(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                 const KeySegment& segment) {
  attend_queries<Avx2>(a, row, head, heads, query_begin, query_end, segment);
}

void dequantize_avx2(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Avx2>(p, row_begin, row_end, dst);
}

void pack_avx2(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Avx2>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_avx2(const Gemm& g, int row_begin, int row_end) { gemm_rows<Avx2>(g, row_begin, row_end); }

void attend_quantized_avx2(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                           int query_end, const KeySegment& segment) {
  attend_quantized_queries<Avx2>(a, row, head, heads, query_begin, query_end, segment);
}

void silu_avx2(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

void halves_avx2(const float* x, Half* out, int64_t n) { halves_range(x, out, n); }

// kquant_x86.h's integer steps with maddubs and madd.
struct Avx2Sums {
  static __m256i bytes(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static __m256i scaled(__m256i acc, __m256i p, __m256i s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s)); }
};

void block_rows_avx2(const BlockProblem& p, int row_begin, int row_end) {
  integer_block_rows<X86BlockDot<Avx2Sums>>(p, row_begin, row_end);
}

void float_block_rows_avx2(const BlockProblem& p, int row_begin, int row_end) {
  float_block_rows(p, row_begin, row_end);
}

void dequantize_blocks_avx2(const BlockProblem& p, int row_begin, int row_end, float* dst) {
  dequantize_block_rows(p, row_begin, row_end, dst);
}

void delta_heads_avx2(const DeltaHeads& d, int begin, int end) { delta_heads_range(d, begin, end); }

}  // namespace minimlx_native
