// AVX-512 (F + BW): 16 floats per vector. Compiled with -mavx512f -mavx512bw -mfma; called only when
// the CPU has them.
#include "attention.h"
#include "delta.h"
#include "gemm.h"
#include "rows.h"
#include "simd_avx512.h"

namespace minimlx_native {

void rows_avx512(const Problem& p, int row_begin, int row_end) { rows<Avx512>(p, row_begin, row_end); }

void attend_avx512(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                   const KeySegment& segment) {
  attend_queries<Avx512>(a, row, head, heads, query_begin, query_end, segment);
}

void dequantize_avx512(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Avx512>(p, row_begin, row_end, dst);
}

void pack_avx512(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Avx512>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_avx512(const Gemm& g, int row_begin, int row_end) { gemm_rows<Avx512>(g, row_begin, row_end); }

void attend_quantized_avx512(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                             int query_end, const KeySegment& segment) {
  attend_quantized_queries<Avx512>(a, row, head, heads, query_begin, query_end, segment);
}

void silu_avx512(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

void halves_avx512(const float* x, Half* out, int64_t n) { halves_range(x, out, n); }

void delta_heads_avx512(const DeltaHeads& d, int begin, int end) { delta_heads_range(d, begin, end); }

}  // namespace minimlx_native
