// The gated delta rule's one-token step over a head's matrix state, in plain loops that the compiler vectorizes for
// each instruction set's file (minimlx/core/recurrent.py's `gated_delta_recurrent` is the reference):
//
//   delta = beta (v - e^g S^T k),  S' = e^g S + k delta^T,  out = S'^T q
//
// S is (key_dims x value_dims), row-major. Each loop runs along a row of S (value features), so every output
// feature sums over the key features in the same order as the reference's reduction.
#pragma once

#include <cstdint>

namespace minimlx_native {

struct DeltaHeads {
  const float* q;       // (rows, key_heads, key_dims), l2-normed and scaled
  const float* k;       // (rows, key_heads, key_dims), l2-normed
  const float* v;       // (rows, value_heads, value_dims)
  const float* decay;   // (rows, value_heads): e^g
  const float* beta;    // (rows, value_heads)
  const float* state;   // (rows, value_heads, key_dims, value_dims)
  float* next;          // the same shape: the state after the token
  float* out;           // (rows, value_heads, value_dims)
  float* scratch;       // value_dims floats per (row, value head) of [begin, end)
  int value_heads, key_heads, key_dims, value_dims;
};

// Heads [begin, end) of all rows' value heads (row * value_heads + head); each value head reads key head
// head / (value_heads / key_heads).
inline void delta_heads_range(const DeltaHeads& d, int begin, int end) {
  const int per_key = d.value_heads / d.key_heads, Dk = d.key_dims, Dv = d.value_dims;
  for (int at = begin; at < end; ++at) {
    const int row = at / d.value_heads, head = at % d.value_heads;
    const int64_t key_at = (static_cast<int64_t>(row) * d.key_heads + head / per_key) * Dk;
    const float *q = d.q + key_at, *k = d.k + key_at, *v = d.v + static_cast<int64_t>(at) * Dv;
    const float decay = d.decay[at], beta = d.beta[at];
    const float* s = d.state + static_cast<int64_t>(at) * Dk * Dv;
    float* n = d.next + static_cast<int64_t>(at) * Dk * Dv;
    float* out = d.out + static_cast<int64_t>(at) * Dv;
    float* delta = d.scratch + static_cast<int64_t>(at - begin) * Dv;
    for (int j = 0; j < Dv; ++j) delta[j] = 0.0f;
    for (int i = 0; i < Dk; ++i) {  // S^T k, the decay applied after: the state is read twice and written once
      const float* si = s + static_cast<int64_t>(i) * Dv;
      const float ki = k[i];
      for (int j = 0; j < Dv; ++j) delta[j] += si[j] * ki;
    }
    for (int j = 0; j < Dv; ++j) {
      delta[j] = (v[j] - delta[j] * decay) * beta;
      out[j] = 0.0f;
    }
    for (int i = 0; i < Dk; ++i) {
      const float* si = s + static_cast<int64_t>(i) * Dv;
      float* ni = n + static_cast<int64_t>(i) * Dv;
      const float ki = k[i], qi = q[i];
      for (int j = 0; j < Dv; ++j) {
        const float updated = si[j] * decay + ki * delta[j];
        ni[j] = updated;
        out[j] += updated * qi;
      }
    }
  }
}

}  // namespace minimlx_native
