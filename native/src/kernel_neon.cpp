// NEON (aarch64 baseline): 4 floats per vector. Not run on the project's x86-64 machine; it follows
// the same chunk order as the other paths (low nibbles of 16 bytes, then high nibbles).
#include "attention.h"
#include "delta.h"
#include "gemm.h"
#include "rows.h"
#include "simd_neon.h"

namespace minimlx_native {

void rows_neon(const Problem& p, int row_begin, int row_end) { rows<Neon>(p, row_begin, row_end); }

void attend_neon(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                 const KeySegment& segment) {
  attend_queries<Neon>(a, row, head, heads, query_begin, query_end, segment);
}

void dequantize_neon(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Neon>(p, row_begin, row_end, dst);
}

void pack_neon(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Neon>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_neon(const Gemm& g, int row_begin, int row_end) { gemm_rows<Neon>(g, row_begin, row_end); }

void attend_quantized_neon(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                           int query_end, const KeySegment& segment) {
  attend_quantized_queries<Neon>(a, row, head, heads, query_begin, query_end, segment);
}

void silu_neon(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

void halves_neon(const float* x, Half* out, int64_t n) { halves_range(x, out, n); }

void delta_heads_neon(const DeltaHeads& d, int begin, int end) { delta_heads_range(d, begin, end); }

}  // namespace minimlx_native
