// AVX-512 (F + BW): 16 floats per vector. Compiled with -mavx512f -mavx512bw -mfma; called only when
// the CPU has them.
#include <immintrin.h>

#include "attention.h"
#include "gemm.h"
#include "rows.h"

namespace minimlx_native {

struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int registers = 32;  // vector registers (zmm0-31)
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
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

void rows_avx512(const Problem& p, int row_begin, int row_end) { rows<Avx512>(p, row_begin, row_end); }

void attend_avx512(const Attention& a, int row, int head, int heads, int query_begin, int query_end) {
  attend_queries<Avx512>(a, row, head, heads, query_begin, query_end);
}

void dequantize_avx512(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Avx512>(p, row_begin, row_end, dst);
}

void pack_avx512(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Avx512>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_avx512(const Gemm& g, int row_begin, int row_end) { gemm_rows<Avx512>(g, row_begin, row_end); }

void attend_quantized_avx512(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                             int query_end) {
  attend_quantized_queries<Avx512>(a, row, head, heads, query_begin, query_end);
}

void silu_avx512(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

}  // namespace minimlx_native
