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

// scores[j] = query . k[keys[j]] for j < count, four keys at a time: four sums side by side keep the FMA
// pipes busy where one sum waits on each of its FMAs (a 64-wide dot is 8 dependent FMAs).
template <class Simd>
inline void dots(const float* query, const float* k, int64_t stride, const int* keys, int count, int D,
                 float* scores) {
  using V = typename Simd::V;
  int j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* rows[4] = {k + keys[j] * stride, k + keys[j + 1] * stride, k + keys[j + 2] * stride,
                            k + keys[j + 3] * stride};
    V acc[4] = {Simd::zero(), Simd::zero(), Simd::zero(), Simd::zero()};
    for (int d = 0; d < D; d += Simd::W) {
      const V q = Simd::load(query + d);
      for (int r = 0; r < 4; ++r) acc[r] = Simd::fma(q, Simd::load(rows[r] + d), acc[r]);
    }
    for (int r = 0; r < 4; ++r) scores[j + r] = Simd::sum(acc[r]);
  }
  for (; j < count; ++j) scores[j] = dot<Simd>(query, k + keys[j] * stride, D);
}

// Queries [query_begin, query_end) of head `head` in batch row `row`.
template <class Simd>
void attend_queries(const Attention& a, int row, int head, int query_begin, int query_end) {
  using V = typename Simd::V;
  constexpr int kVectors = 8;  // output vectors summed per pass over the values: 8 independent FMA chains
  const int D = a.head_dim, past = a.keys - a.queries, kv_head = head / (a.heads / a.kv_heads);
  const float* k = a.k + row * a.k_strides[0] + kv_head * a.k_strides[1];
  const float* v = a.v + row * a.v_strides[0] + kv_head * a.v_strides[1];
  thread_local std::vector<float> scores, query;
  thread_local std::vector<int> shown_keys;
  scores.resize(a.keys);
  shown_keys.resize(a.keys);
  query.resize(D);
  for (int i = query_begin; i < query_end; ++i) {
    const float* q = a.q + row * a.q_strides[0] + head * a.q_strides[1] + i * a.q_strides[2];
    for (int d = 0; d < D; ++d) query[d] = q[d] * a.scale;
    const int seen = past + i + 1;
    const bool* shown = a.mask ? a.mask + row * a.mask_strides[0] + i * a.mask_strides[1] : nullptr;
    int count = 0;
    for (int j = 0; j < seen; ++j)
      if (!shown || shown[j * a.mask_strides[2]]) shown_keys[count++] = j;
    float* out = a.out + ((static_cast<int64_t>(row) * a.heads + head) * a.queries + i) * D;
    if (count == 0) {  // every key hidden
      std::fill(out, out + D, 0.0f);
      continue;
    }
    dots<Simd>(query.data(), k, a.k_strides[2], shown_keys.data(), count, D, scores.data());
    const float top = *std::max_element(scores.begin(), scores.begin() + count);
    for (int j = 0; j < count; ++j) scores[j] = exp_clamped(scores[j] - top);  // a loop the compiler vectorizes
    V sum = Simd::zero();
    int j = 0;
    for (; j + Simd::W <= count; j += Simd::W) sum = Simd::add(sum, Simd::load(scores.data() + j));
    float total = Simd::sum(sum);
    for (; j < count; ++j) total += scores[j];
    const V norm = Simd::set1(1.0f / total);
    for (int c = 0; c < D; c += kVectors * Simd::W) {
      const int width = std::min(kVectors * Simd::W, D - c) / Simd::W;
      V acc[kVectors];
      for (int w = 0; w < width; ++w) acc[w] = Simd::zero();
      for (int j = 0; j < count; ++j) {
        const V weight = Simd::set1(scores[j]);
        const float* value = v + shown_keys[j] * a.v_strides[2] + c;
        for (int w = 0; w < width; ++w) acc[w] = Simd::fma(weight, Simd::load(value + w * Simd::W), acc[w]);
      }
      for (int w = 0; w < width; ++w) Simd::store(out + c + w * Simd::W, Simd::mul(acc[w], norm));
    }
  }
}

}  // namespace minimlx_native
