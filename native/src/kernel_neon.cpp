// NEON (aarch64 baseline): 4 floats per vector. Not run on the project's x86-64 machine; it follows
// the same chunk order as the other paths (low nibbles of 16 bytes, then high nibbles).
#include <arm_neon.h>

#include "attention.h"
#include "gemm.h"
#include "rows.h"

namespace minimlx_native {

struct Neon {
  using V = float32x4_t;
  static constexpr int W = 4;
  static constexpr int registers = 32;  // vector registers (v0-v31)
  static V zero() { return vdupq_n_f32(0.0f); }
  static V set1(float v) { return vdupq_n_f32(v); }
  static V load(const float* p) { return vld1q_f32(p); }
  static V load(const Half* p) { return vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(p))); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static float sum(V v) { return vaddvq_f32(v); }
  // out[r] = the sum of v[r]'s lanes, r < 4: pairwise sums twice.
  static void sum4(const V* v, float* out) { vst1q_f32(out, vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]))); }
  static void widen(uint8x16_t bytes, V* q) {
    const uint16x8_t low = vmovl_u8(vget_low_u8(bytes)), high = vmovl_u8(vget_high_u8(bytes));
    q[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(low)));
    q[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(low)));
    q[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(high)));
    q[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(high)));
  }
  static void unpack4(const uint8_t* p, V* q) {
    const uint8x16_t bytes = vld1q_u8(p);
    widen(vandq_u8(bytes, vdupq_n_u8(0xF)), q);
    widen(vshrq_n_u8(bytes, 4), q + 4);
  }
  static void unpack8(const uint8_t* p, V* q) {
    widen(vld1q_u8(p), q);
    widen(vld1q_u8(p + 16), q + 4);
  }
};

void rows_neon(const Problem& p, int row_begin, int row_end) { rows<Neon>(p, row_begin, row_end); }

void attend_neon(const Attention& a, int row, int head, int heads, int query_begin, int query_end) {
  attend_queries<Neon>(a, row, head, heads, query_begin, query_end);
}

void dequantize_neon(const Problem& p, int row_begin, int row_end, float* dst) {
  dequantize_rows<Neon>(p, row_begin, row_end, dst);
}

void pack_neon(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  pack_panels<Neon>(x, M, K, panels, panel_begin, panel_end);
}

void gemm_neon(const Gemm& g, int row_begin, int row_end) { gemm_rows<Neon>(g, row_begin, row_end); }

void attend_quantized_neon(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                           int query_end) {
  attend_quantized_queries<Neon>(a, row, head, heads, query_begin, query_end);
}

void silu_neon(const float* x, float* out, int64_t begin, int64_t end) { silu_range(x, out, begin, end); }

}  // namespace minimlx_native
