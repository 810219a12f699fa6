// Causal attention for MLX's CPU backend, shared by every instruction set; `Simd` supplies vectors of
// `Simd::W` floats. Query i of a chunk of `queries` (the last `queries` of `keys` positions) sees keys
// 0 .. keys - queries + i:
//
//   out[i] = sum_j e^(s_j - s_max) v_j / sum_j e^(s_j - s_max),  s_j = scale * q_i . k_j
//
// computed one query at a time, for the heads that share its kv head together: their scores in a buffer,
// their exponentials, then the weighted sums of the value rows. Nothing of the masked part of the score matrix is computed; keys an explicit mask hides
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

// scores[h * stride_h + j] = queries[h] . k[keys[j]] for the H queries and j < count, KB keys at a time: each key
// row is loaded once for the H queries, and the H * KB sums side by side keep the FMA pipes busy where one sum
// waits on each of its FMAs (a 64-wide dot is 8 dependent FMAs).
template <class Simd, int H>
inline void dots(const float* queries, const float* k, int64_t stride, const int* keys, int count, int D,
                 float* scores, int score_stride) {
  using V = typename Simd::V;
  constexpr int KB = H * 4 + 4 + H <= Simd::registers ? 4 : H * 2 + 2 + H <= Simd::registers ? 2 : 1;
  int j = 0;
  for (; j + KB <= count; j += KB) {
    const float* rows[KB];
    for (int r = 0; r < KB; ++r) rows[r] = k + keys[j + r] * stride;
    V acc[H][KB];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < KB; ++r) acc[h][r] = Simd::zero();
    for (int d = 0; d < D; d += Simd::W) {
      V key[KB];
      for (int r = 0; r < KB; ++r) key[r] = Simd::load(rows[r] + d);
      for (int h = 0; h < H; ++h) {
        const V q = Simd::load(queries + h * D + d);
        for (int r = 0; r < KB; ++r) acc[h][r] = Simd::fma(q, key[r], acc[h][r]);
      }
    }
    for (int h = 0; h < H; ++h) {
      if constexpr (KB == 4) {
        Simd::sum4(acc[h], scores + h * score_stride + j);
      } else {
        for (int r = 0; r < KB; ++r) scores[h * score_stride + j + r] = Simd::sum(acc[h][r]);
      }
    }
  }
  for (; j < count; ++j)
    for (int h = 0; h < H; ++h) scores[h * score_stride + j] = dot<Simd>(queries + h * D, k + keys[j] * stride, D);
}

// Queries [query_begin, query_end) of the H heads head, head + 1, ... (which share one kv head) in batch row `row`.
// The heads of a query go together: its shown keys are found once, and each key and value row is read once for
// all of them (SmolLM2's 9 heads read their 3 kv heads a third as often as one head at a time).
template <class Simd, int H>
void attend_heads(const Attention& a, int row, int head, int query_begin, int query_end) {
  using V = typename Simd::V;
  constexpr int kVectors = 8;  // output vectors summed per pass over the values: independent FMA chains
  constexpr int width = kVectors / H > 0 ? kVectors / H : 1;  // vectors of each head's output per pass
  const int D = a.head_dim, past = a.keys - a.queries, kv_head = head / (a.heads / a.kv_heads);
  const float* k = a.k + row * a.k_strides[0] + kv_head * a.k_strides[1];
  const float* v = a.v + row * a.v_strides[0] + kv_head * a.v_strides[1];
  thread_local std::vector<float> scores, queries;
  thread_local std::vector<int> shown_keys;
  scores.resize(static_cast<size_t>(H) * a.keys);
  shown_keys.resize(a.keys);
  queries.resize(static_cast<size_t>(H) * D);
  for (int i = query_begin; i < query_end; ++i) {
    for (int h = 0; h < H; ++h) {
      const float* q = a.q + row * a.q_strides[0] + (head + h) * a.q_strides[1] + i * a.q_strides[2];
      for (int d = 0; d < D; ++d) queries[h * D + d] = q[d] * a.scale;
    }
    const int seen = past + i + 1;
    const bool* shown = a.mask ? a.mask + row * a.mask_strides[0] + i * a.mask_strides[1] : nullptr;
    int count = 0;
    for (int j = 0; j < seen; ++j)
      if (!shown || shown[j * a.mask_strides[2]]) shown_keys[count++] = j;
    float* out[H];
    for (int h = 0; h < H; ++h) out[h] = a.out + ((static_cast<int64_t>(row) * a.heads + head + h) * a.queries + i) * D;
    if (count == 0) {  // every key hidden
      for (int h = 0; h < H; ++h) std::fill(out[h], out[h] + D, 0.0f);
      continue;
    }
    dots<Simd, H>(queries.data(), k, a.k_strides[2], shown_keys.data(), count, D, scores.data(), a.keys);
    V norm[H];
    for (int h = 0; h < H; ++h) {
      float* p = scores.data() + static_cast<int64_t>(h) * a.keys;
      const float top = *std::max_element(p, p + count);
      for (int j = 0; j < count; ++j) p[j] = exp_clamped(p[j] - top);  // a loop the compiler vectorizes
      V sum = Simd::zero();
      int j = 0;
      for (; j + Simd::W <= count; j += Simd::W) sum = Simd::add(sum, Simd::load(p + j));
      float total = Simd::sum(sum);
      for (; j < count; ++j) total += p[j];
      norm[h] = Simd::set1(1.0f / total);
    }
    for (int c = 0; c < D; c += width * Simd::W) {
      const int vectors = std::min(width * Simd::W, D - c) / Simd::W;
      V acc[H][width];
      for (int h = 0; h < H; ++h)
        for (int w = 0; w < vectors; ++w) acc[h][w] = Simd::zero();
      for (int j = 0; j < count; ++j) {
        const float* value = v + shown_keys[j] * a.v_strides[2] + c;
        V values[width];
        for (int w = 0; w < vectors; ++w) values[w] = Simd::load(value + w * Simd::W);
        for (int h = 0; h < H; ++h) {
          const V weight = Simd::set1(scores[static_cast<int64_t>(h) * a.keys + j]);
          for (int w = 0; w < vectors; ++w) acc[h][w] = Simd::fma(weight, values[w], acc[h][w]);
        }
      }
      for (int h = 0; h < H; ++h)
        for (int w = 0; w < vectors; ++w) Simd::store(out[h] + c + w * Simd::W, Simd::mul(acc[h][w], norm[h]));
    }
  }
}

// `heads` (at most kHeadsTogether) heads of one kv head from `head`.
template <class Simd>
void attend_queries(const Attention& a, int row, int head, int heads, int query_begin, int query_end) {
  switch (heads) {
    case 1: return attend_heads<Simd, 1>(a, row, head, query_begin, query_end);
    case 2: return attend_heads<Simd, 2>(a, row, head, query_begin, query_end);
    case 3: return attend_heads<Simd, 3>(a, row, head, query_begin, query_end);
    default: return attend_heads<Simd, 4>(a, row, head, query_begin, query_end);
  }
}

}  // namespace minimlx_native
