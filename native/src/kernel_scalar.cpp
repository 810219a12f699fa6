// Portable kernels: the input preparation and quantization, and scalar row loops for machines without the SIMD
// paths (the integer one is also the reference the SIMD ones are tested against).
#include <algorithm>
#include <cmath>

#include "attention.h"
#include "delta.h"
#include "gemm.h"
#include "integer.h"
#include "kquant.h"
#include "rows.h"

namespace minimlx_native {

void prepare_inputs(const float* x, int M, int K, int group_size, int bits, float* x_out, float* xsum_out) {
  const int groups = K / group_size;
  for (int m = 0; m < M; ++m) {
    const float* row = x + static_cast<int64_t>(m) * K;
    float* out = x_out + static_cast<int64_t>(m) * K;
    if (bits == 4) {
      for (int k = 0; k < K; k += 32)
        for (int j = 0; j < 16; ++j) {
          out[k + j] = row[k + 2 * j];
          out[k + 16 + j] = row[k + 2 * j + 1];
        }
    } else {
      std::copy(row, row + K, out);
    }
  }
  for (int m = integer_rows_from(M); m < M; ++m)  // only the rows that read them: a chain of dependent adds
    for (int g = 0; g < groups; ++g) {
      const float* row = x + static_cast<int64_t>(m) * K + static_cast<int64_t>(g) * group_size;
      float sum = 0.0f;
      for (int k = 0; k < group_size; ++k) sum += row[k];
      xsum_out[static_cast<int64_t>(m) * groups + g] = sum;
    }
}

int quantized_stride(int K, int span) { return (K + span - 1) / span * span; }

// One block of quantize_inputs in plain C++.
struct ScalarBlock {
  static float largest(const float* x) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    return amax;
  }
  template <bool NIBBLES>
  static int quantize(const float* x, float& d, int8_t* first, int8_t* second) {
    d = largest(x) / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int total = 0;
    for (int i = 0; i < 32; ++i) {  // rounded to nearest (even on ties) by adding 1.5 * 2^23 and taking it away
      const int8_t q = static_cast<int8_t>(x[i] * inverse + 12582912.0f - 12582912.0f);
      if constexpr (NIBBLES) (i % 2 ? second : first)[i / 2] = q;
      else first[i] = q;
      total += q;
    }
    return total;
  }
};

void quantize_inputs(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                     const QuantizedInputs& out) {
  quantize_rows<ScalarBlock>(x, M, K, group_size, span, lanes, nibbles, out);
}

struct Scalar {
  using V = float;
  static constexpr int W = 1;
  static constexpr int registers = 16;  // vector registers (what the compiler keeps in registers)
  static V zero() { return 0.0f; }
  static V set1(float v) { return v; }
  static V load(const float* p) { return *p; }
  static V load(const Half* p) { return static_cast<float>(*p); }
  static V load(const uint8_t* p) { return static_cast<float>(*p); }
  static void store(float* p, V v) { *p = v; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static float sum(V v) { return v; }
  static void sum4(const V* v, float* out) { std::copy(v, v + 4, out); }
  static void unpack4(const uint8_t* p, V* q) {
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<float>(p[i] & 0xF);
      q[16 + i] = static_cast<float>(p[i] >> 4);
    }
  }
  static void unpack8(const uint8_t* p, V* q) {
    for (int i = 0; i < 32; ++i) q[i] = static_cast<float>(p[i]);
  }
};

// The integer step in plain C++: one block of 32 codes at a time (4-bit ones in nibble order), summed into one lane.
struct ScalarDot {
  template <int BITS>
  static constexpr int span = 32;
  struct Codes {
    uint8_t q[32];
  };
  template <int BITS>
  static constexpr int offset = 0;
  template <int BITS>
  static Codes codes(const uint8_t* p) {
    Codes c;
    for (int i = 0; i < 32; ++i) c.q[i] = BITS == 4 ? (i < 16 ? p[i] & 0xF : p[i - 16] >> 4) : p[i];
    return c;
  }
  template <int BITS>
  static float dot(const Codes& c, const int8_t* xq) {
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += c.q[i] * xq[i];
    return static_cast<float>(sum);
  }
  template <int N, class S>
  static float spread(const S* s) {
    return static_cast<float>(s[0]);
  }
};

void rows_scalar(const Problem& p, int row_begin, int row_end) { rows<Scalar>(p, row_begin, row_end); }

void integer_rows_scalar(const Problem& p, int row_begin, int row_end) {
  integer_rows<Scalar, ScalarDot>(p, row_begin, row_end);
}

void attend_scalar(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                   const KeySegment& segment) {
  attend_queries<Scalar>(a, row, head, heads, query_begin, query_end, segment);
}

void dequantize_scalar(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Scalar>(p, row_begin, row_end, dst);
}

void pack_scalar(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Scalar>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_scalar(const Gemm& g, int row_begin, int row_end) { gemm_rows<Scalar>(g, row_begin, row_end); }

void attend_quantized_scalar(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                             int query_end, const KeySegment& segment) {
  attend_quantized_queries<Scalar>(a, row, head, heads, query_begin, query_end, segment);
}

void silu_scalar(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

void halves_scalar(const float* x, Half* out, int64_t n) { halves_range(x, out, n); }

void block_rows_scalar(const BlockProblem& p, int row_begin, int row_end) {
  integer_block_rows<ScalarBlockDot>(p, row_begin, row_end);
}

void float_block_rows_scalar(const BlockProblem& p, int row_begin, int row_end) {
  float_block_rows(p, row_begin, row_end);
}

void dequantize_blocks_scalar(const BlockProblem& p, int row_begin, int row_end, float* dst) {
  dequantize_block_rows(p, row_begin, row_end, dst);
}

void delta_heads_scalar(const DeltaHeads& d, int begin, int end) { delta_heads_range(d, begin, end); }

}  // namespace minimlx_native
