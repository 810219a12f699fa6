// The integer products with AVX-512 VNNI: vpdpbusd on 512-bit vectors. Compiled with -mavx512f -mavx512bw
// -mavx512vnni -mfma -mf16c; called only when the CPU has them.
#include <array>

#include "integer.h"
#include "kquant_avx512.h"
#include "kquant_gemm_avx512.h"
#include "simd_avx512.h"
#include "simd_x86.h"

namespace minimlx_native {

// A step is one load of 64 bytes: 128 4-bit values (four blocks, four lanes each: the low nibbles, then the high
// ones, each a vector of codes) or 64 8-bit ones (two blocks, eight lanes each). vpdpbusd sums four u8 x s8
// products into each 32-bit lane, 8-bit codes included.
struct Avx512Vnni {
  template <int BITS>
  static constexpr int span = BITS == 4 ? 128 : 64;
  template <int BITS>
  static constexpr int offset = 0;
  struct Codes {
    __m512i low, high;  // 8-bit codes: `low`
  };
  template <int BITS>
  static Codes split(__m512i bytes) {
    if constexpr (BITS == 8) return {bytes, bytes};
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    return {_mm512_and_si512(bytes, nibble), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)};
  }
  template <int BITS>
  static Codes codes(const uint8_t* p) {
    return split<BITS>(_mm512_loadu_si512(p));
  }
  template <int BITS>
  static Codes partial(const uint8_t* p, int bytes) {
    return split<BITS>(_mm512_maskz_loadu_epi8((__mmask64{1} << bytes) - 1, p));
  }
  template <int BITS>
  static __m512 dot(const Codes& codes, const int8_t* xq) {
    __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes.low, _mm512_loadu_si512(xq));
    if constexpr (BITS == 4) sums = _mm512_dpbusd_epi32(sums, codes.high, _mm512_loadu_si512(xq + 64));
    return _mm512_cvtepi32_ps(sums);
  }
  template <int N>  // lane l takes scale l * N / 16
  static constexpr std::array<int32_t, 16> index = [] {
    std::array<int32_t, 16> lanes{};
    for (int l = 0; l < 16; ++l) lanes[l] = l * N / 16;
    return lanes;
  }();
  template <int N, class S>
  static __m512 spread(const S* s) {
    if constexpr (N == 1) return _mm512_set1_ps(static_cast<float>(*s));
    else return _mm512_permutexvar_ps(_mm512_loadu_si512(index<N>.data()), _mm512_castps128_ps512(load_first<N>(s)));
  }
  template <int N, class S>
  static __m512 spread(const S* s, int count) {
    const __mmask16 mask = (1 << count) - 1;
    __m512 first;
    if constexpr (sizeof(S) == 2) first = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(mask, s)));
    else first = _mm512_maskz_loadu_ps(mask, s);
    return _mm512_permutexvar_ps(_mm512_loadu_si512(index<N>.data()), first);
  }
};

// One block of quantize_inputs in two vectors of 16 (the codes as scalar code rounds them: to nearest, even on ties).
struct Avx512Block {
  static float largest(const float* x) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  }
  template <bool NIBBLES>
  static int quantize(const float* x, float& d, int8_t* first, int8_t* second) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    d = largest(x) / 127.0f;
    const __m512 inverse = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    if constexpr (NIBBLES) {
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qa, even, qb)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qa, odd, qb)));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(first + 16), _mm512_cvtepi32_epi8(qb));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  }
};

void quantize_inputs_avx512vnni(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                                const QuantizedInputs& out) {
  quantize_rows<Avx512Block>(x, M, K, group_size, span, lanes, nibbles, out);
}

void integer_rows_avx512vnni(const Problem& p, int row_begin, int row_end) {
  integer_rows<Avx512, Avx512Vnni>(p, row_begin, row_end);
}

void block_rows_avx512vnni(const BlockProblem& p, int row_begin, int row_end) {
  integer_block_rows<Avx512BlockDot>(p, row_begin, row_end);
}

void float_block_rows_avx512vnni(const BlockProblem& p, int row_begin, int row_end) {
  float_block_rows(p, row_begin, row_end);
}

void dequantize_blocks_avx512vnni(const BlockProblem& p, int row_begin, int row_end, float* dst) {
  for (int n = row_begin; n < row_end; ++n)
    Avx512BlockDot::dequantize(p.type, p.w + n * p.row_bytes, p.K, dst + static_cast<int64_t>(n - row_begin) * p.K);
}

void block_gemm_avx512vnni(const BlockProblem& p, const GemmInputs& x, int row_begin, int row_end) {
  gemm_block_rows(p, x, row_begin, row_end);
}

}  // namespace minimlx_native
