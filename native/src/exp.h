// e^x, and silu built on it, in plain branch-free C++ that the compiler vectorizes for each instruction
// set's file (minimlx/core/cpu_math.py composes the same arithmetic from MLX ops).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace minimlx_native {

// e^x to about 2e-7 relative for x in [-87, 88], and e^-87 / e^88 outside it: 2^n written into the exponent
// bits times e^r's Taylor polynomial of degree 7, n = round(x / ln 2), |r| <= ln(2) / 2.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;  // adding 1.5 * 2^23 rounds
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln 2 split: n * high is exact
  const float r2 = r * r;
  const float low = (1.0f + r) + (0.5f + r * (1.0f / 6)) * r2;
  const float high = ((1.0f / 24) + r * (1.0f / 120)) + ((1.0f / 720) + r * (1.0f / 5040)) * r2;
  return (low + high * (r2 * r2)) * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// out[i] = x[i] / (1 + e^-x[i]) for i in [begin, end).
inline void silu_range(const float* x, float* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) out[i] = x[i] / (1.0f + exp_clamped(-x[i]));
}

}  // namespace minimlx_native
