// The integer products with AVX-512 VNNI: vpdpbusd on 512-bit vectors, a step of 64 values (two blocks of
// the inputs, in lanes 0-7 and 8-15). Compiled with -mavx512f -mavx512bw -mavx512vnni -mfma; called only when
// the CPU has them.
#include "integer.h"
#include "simd_avx512.h"

namespace minimlx_native {

// The codes of 64 values as unsigned bytes in order (4-bit bytes widened and split as Avx2Codes does), and
// vpdpbusd's four u8 x s8 products per 32-bit lane, 8-bit codes included.
struct Avx512Vnni {
  static constexpr int span = 64;
  using Codes = __m512i;
  template <int BITS>
  static constexpr int offset = 0;
  template <int BITS>
  static Codes codes(const uint8_t* p) {
    if constexpr (BITS == 8) return _mm512_loadu_si512(p);
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_and_si512(_mm512_or_si512(bytes, _mm512_slli_epi16(bytes, 4)), _mm512_set1_epi16(0x0F0F));
  }
  template <int BITS>
  static __m512 dot(__m512i codes, const int8_t* xq) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(xq)));
  }
  static __m512 spread(const float* s) {
    const __m256d high = _mm256_castps_pd(_mm256_set1_ps(s[1]));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(s[0])), high, 1));
  }
};

void integer_rows_avx512vnni(const Problem& p, int row_begin, int row_end) {
  integer_rows<Avx512, Avx512Vnni>(p, row_begin, row_end);
}

}  // namespace minimlx_native
