// NEON vectors of 4 floats (aarch64 baseline), for kernel_neon.cpp and kernel_neondot.cpp.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "kernel.h"

namespace minimlx_native {

struct Neon {
  using V = float32x4_t;
  static constexpr int W = 4;
  static constexpr int registers = 32;  // vector registers (v0-v31)
  static V zero() { return vdupq_n_f32(0.0f); }
  static V set1(float v) { return vdupq_n_f32(v); }
  static V load(const float* p) { return vld1q_f32(p); }
  static V load(const Half* p) { return vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(p))); }
  static V load(const uint8_t* p) {
    uint64_t bytes = 0;
    std::memcpy(&bytes, p, 4);
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(bytes)))));
  }
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

}  // namespace minimlx_native
