// Causal attention for MLX's CPU backend, shared by every instruction set; `Simd` supplies vectors of
// `Simd::W` floats. Query i of a chunk of `queries` (the last `queries` of `keys` positions) sees keys
// 0 .. keys - queries + i:
//
//   out[i] = sum_j e^(s_j - s_max) v_j / sum_j e^(s_j - s_max),  s_j = scale * q_i . k_j
//
// computed one query at a time: its scores in a buffer, their exponentials, then the weighted sum of
// the value rows. Nothing of the masked part of the score matrix is computed; keys an explicit mask hides
// (a decode step over a cache of fixed capacity, padded rows of a batch) get a weight of zero.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "exp.h"
#include "kernel.h"

namespace minimlx_native {

template <class Simd>
inline float dot(const float* a, const float* b, int n) {
  typename Simd::V acc = Simd::zero();
  for (int d = 0; d < n; d += Simd::W) acc = Simd::fma(Simd::load(a + d), Simd::load(b + d), acc);
  return Simd::sum(acc);
}

// Queries [query_begin, query_end) of head `head` in batch row `row`.
template <class Simd>
void attend_queries(const Attention& a, int row, int head, int query_begin, int query_end) {
  using V = typename Simd::V;
  const int D = a.head_dim, past = a.keys - a.queries, kv_head = head / (a.heads / a.kv_heads);
  const float* k = a.k + row * a.k_strides[0] + kv_head * a.k_strides[1];
  const float* v = a.v + row * a.v_strides[0] + kv_head * a.v_strides[1];
  thread_local std::vector<float> scores, query;
  scores.resize(a.keys);
  query.resize(D);
  for (int i = query_begin; i < query_end; ++i) {
    const float* q = a.q + row * a.q_strides[0] + head * a.q_strides[1] + i * a.q_strides[2];
    for (int d = 0; d < D; ++d) query[d] = q[d] * a.scale;
    const int seen = past + i + 1;
    const bool* shown = a.mask ? a.mask + row * a.mask_strides[0] + i * a.mask_strides[1] : nullptr;
    auto hidden = [&](int j) { return shown && !shown[j * a.mask_strides[2]]; };
    float top = -3.4e38f;
    for (int j = 0; j < seen; ++j) {
      if (hidden(j)) continue;
      scores[j] = dot<Simd>(query.data(), k + j * a.k_strides[2], D);
      top = std::max(top, scores[j]);
    }
    float total = 0.0f;
    for (int j = 0; j < seen; ++j) {
      scores[j] = hidden(j) ? 0.0f : exp_clamped(scores[j] - top);
      total += scores[j];
    }
    float* out = a.out + ((static_cast<int64_t>(row) * a.heads + head) * a.queries + i) * D;
    if (total == 0.0f) {  // every key hidden
      std::fill(out, out + D, 0.0f);
      continue;
    }
    for (int c = 0; c < D; c += 4 * Simd::W) {  // 4 vectors of the output row at a time
      const int width = std::min(4 * Simd::W, D - c) / Simd::W;
      V acc[4] = {Simd::zero(), Simd::zero(), Simd::zero(), Simd::zero()};
      for (int j = 0; j < seen; ++j) {
        if (scores[j] == 0.0f) continue;
        const V weight = Simd::set1(scores[j]);
        const float* value = v + j * a.v_strides[2] + c;
        for (int w = 0; w < width; ++w) acc[w] = Simd::fma(weight, Simd::load(value + w * Simd::W), acc[w]);
      }
      const V norm = Simd::set1(1.0f / total);
      for (int w = 0; w < width; ++w) Simd::store(out + c + w * Simd::W, Simd::mul(acc[w], norm));
    }
  }
}

}  // namespace minimlx_native
