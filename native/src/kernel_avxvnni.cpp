// The integer products with AVX-VNNI (vpdpbusd on 256-bit vectors, the VEX form of CPUs without AVX-512). Compiled
// with -mavx2 -mfma -mf16c -mavxvnni; called only when the CPU has them.
#include "integer.h"
#include "simd_avx2.h"

namespace minimlx_native {

// The integer step: vpdpbusd sums four u8 x s8 products into each 32-bit lane, 8-bit codes included.
struct AvxVnni : Avx2Codes {
  template <int BITS>
  static constexpr int offset = 0;
  template <int BITS>
  static __m256 dot(const Codes& codes, const int8_t* xq) {
    const __m256i* x = reinterpret_cast<const __m256i*>(xq);
    __m256i sums = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes.low, _mm256_loadu_si256(x));
    if constexpr (BITS == 4) sums = _mm256_dpbusd_avx_epi32(sums, codes.high, _mm256_loadu_si256(x + 1));
    return _mm256_cvtepi32_ps(sums);
  }
};

void integer_rows_avxvnni(const Problem& p, int row_begin, int row_end) {
  integer_rows<Avx2, AvxVnni>(p, row_begin, row_end);
}

}  // namespace minimlx_native
