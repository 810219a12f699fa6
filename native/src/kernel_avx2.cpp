// AVX2 + FMA + F16C: 8 floats per vector. Compiled with -mavx2 -mfma -mf16c; called only when the CPU has them.
#include "attention.h"
#include "gemm.h"
#include "integer.h"
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

void rows_avx2(const Problem& p, int row_begin, int row_end) { rows<Avx2>(p, row_begin, row_end); }

void integer_rows_avx2(const Problem& p, int row_begin, int row_end) {
  integer_rows<Avx2, Maddubs>(p, row_begin, row_end);
}

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
