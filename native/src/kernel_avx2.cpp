// AVX2 + FMA + F16C: 8 floats per vector. Compiled with -mavx2 -mfma -mf16c; called only when the CPU has them.
#include <immintrin.h>

#include "attention.h"
#include "gemm.h"
#include "rows.h"

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

void rows_avx2(const Problem& p, int row_begin, int row_end) { rows<Avx2>(p, row_begin, row_end); }

void attend_avx2(const Attention& a, int row, int head, int heads, int query_begin, int query_end) {
  attend_queries<Avx2>(a, row, head, heads, query_begin, query_end);
}

void dequantize_avx2(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Avx2>(p, row_begin, row_end, dst);
}

void pack_avx2(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Avx2>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_avx2(const Gemm& g, int row_begin, int row_end) { gemm_rows<Avx2>(g, row_begin, row_end); }

void attend_quantized_avx2(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                           int query_end) {
  attend_quantized_queries<Avx2>(a, row, head, heads, query_begin, query_end);
}

void silu_avx2(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

}  // namespace minimlx_native
