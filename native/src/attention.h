// Causal attention for MLX's CPU backend, shared by every instruction set; `Simd` supplies vectors of
// `Simd::W` floats. Query i of a chunk of `queries` (the last `queries` of `keys` positions) sees keys
// 0 .. keys - queries + i:
//
//   out[i] = sum_j e^(s_j - s_max) v_j / sum_j e^(s_j - s_max),  s_j = scale * q_i . k_j
//
// computed one query at a time, for the heads that share its kv head together: their scores in a buffer,
// their exponentials, then the weighted sums of the value rows. Nothing of the masked part of the score matrix is computed; keys an explicit mask hides
// (a decode step over a cache of fixed capacity, padded rows of a batch) get a weight of zero. A work item reads the
// keys of one `KeySegment`: all of them, or one segment of a decode step's, whose sums the caller combines.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "exp.h"
#include "kernel.h"

namespace minimlx_native {

template <class Simd, class KV>
inline float dot(const float* a, const KV* b, int n) {
  typename Simd::V acc = Simd::zero();
  for (int d = 0; d < n; d += Simd::W) acc = Simd::fma(Simd::load(a + d), Simd::load(b + d), acc);
  return Simd::sum(acc);
}

// scores[h * stride_h + j] = queries[h] . k[keys[j]] for the H queries and j < count, KB keys at a time: each key
// row is loaded once for the H queries, and the H * KB sums side by side keep the FMA pipes busy where one sum
// waits on each of its FMAs (a 64-wide dot is 8 dependent FMAs).
template <class Simd, int H, class KV>
inline void dots(const float* queries, const KV* k, int64_t stride, const int* keys, int count, int D,
                 float* scores, int score_stride) {
  using V = typename Simd::V;
  constexpr int KB = H * 4 + 4 + H <= Simd::registers ? 4 : H * 2 + 2 + H <= Simd::registers ? 2 : 1;
  int j = 0;
  for (; j + KB <= count; j += KB) {
    const KV* rows[KB];
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
    for (int h = 0; h < H; ++h) scores[h * score_stride + j] = dot<Simd, KV>(queries + h * D, k + keys[j] * stride, D);
}

// Queries [query_begin, query_end) of the H heads head, head + 1, ... (which share one kv head) in batch row `row`.
// The heads of a query go together: its shown keys are found once, and each key and value row is read once for
// all of them (SmolLM2's 9 heads read their 3 kv heads a third as often as one head at a time).
// The keys of `segment` that query `i` of `row` sees (their indices into `keys`; how many is returned), and where its
// heads' results go (`at`: their rows of the segment's out, tops and totals). A query that sees none of them gets
// zeros, or a total of 0 in a segment. The float and the quantized attention share it.
template <int H, class Args>
inline int visible_keys(const Args& a, const KeySegment& segment, int row, int head, int i, int seen, int* keys,
                        int64_t at[H]) {
  const bool* shown = a.mask ? a.mask + row * a.mask_strides[0] + i * a.mask_strides[1] : nullptr;
  const int D = a.head_dim;
  int count = 0;
  if (!shown) {  // causal alone: the query sees keys 0 .. seen - 1
    for (int j = segment.begin; j < std::min(seen, segment.end); ++j) keys[count++] = j;
  } else {
    for (int j = 0, number = 0; j < seen && number < segment.end; ++j)
      if (shown[j * a.mask_strides[2]] && number++ >= segment.begin) keys[count++] = j;
  }
  for (int h = 0; h < H; ++h) {
    at[h] = (static_cast<int64_t>(row) * a.heads + head + h) * a.queries + i;
    if (count > 0) continue;
    if (segment.totals) segment.totals[at[h]] = 0.0f;
    else std::fill(segment.out + at[h] * D, segment.out + (at[h] + 1) * D, 0.0f);
  }
  return count;
}

// What a head's weighted sum of values is multiplied by once its scores' top and sum of exponentials are known:
// 1 / total over every key; 1 over a segment, whose top and total are kept for the combine.
inline float value_factor(const KeySegment& segment, int64_t at, float top, float total) {
  if (!segment.tops) return 1.0f / total;
  segment.tops[at] = top;
  segment.totals[at] = total;
  return 1.0f;
}

// Running maxima and sums kept side by side: the compiler turns them into vector ones, where a single running one waits
// on each comparison or addition before the next (a scalar chain of 4,096 keys).
constexpr int kLanes = 16;

// The largest of p[0 .. count).
inline float top_of(const float* p, int count) {
  float tops[kLanes];
  std::fill(tops, tops + kLanes, -std::numeric_limits<float>::infinity());
  int j = 0;
  for (; j + kLanes <= count; j += kLanes)
    for (int l = 0; l < kLanes; ++l) tops[l] = std::max(tops[l], p[j + l]);
  for (; j < count; ++j) tops[0] = std::max(tops[0], p[j]);
  return *std::max_element(tops, tops + kLanes);
}

// The sum of p[0 .. count).
inline float sum_of(const float* p, int count) {
  float sums[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= count; j += kLanes)
    for (int l = 0; l < kLanes; ++l) sums[l] += p[j + l];
  for (; j < count; ++j) sums[0] += p[j];
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += sums[l];
  return total;
}

// The sum of p[j] * b[j] over j < count.
inline float dot_of(const float* p, const float* b, int count) {
  float sums[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= count; j += kLanes)
    for (int l = 0; l < kLanes; ++l) sums[l] += p[j + l] * b[j + l];
  for (; j < count; ++j) sums[0] += p[j] * b[j];
  return sum_of(sums, kLanes);
}

// out[h][c .. c + WIDTH * W) = norm[h] * sum_j p_hj v[keys[j]][c ..]: WIDTH vectors of each of the H heads' outputs
// summed in one pass over the value rows, each row's vectors loaded once for the H heads. WIDTH is known here, so the
// sums stay in registers.
template <class Simd, int H, int WIDTH, class KV>
inline void weighted_values(const KV* v, int64_t stride, const int* keys, int count, const float* weights,
                            int64_t weight_stride, const typename Simd::V* norm, float* const* out, int c) {
  using V = typename Simd::V;
  V acc[H][WIDTH];
  for (int h = 0; h < H; ++h)
    for (int w = 0; w < WIDTH; ++w) acc[h][w] = Simd::zero();
  for (int j = 0; j < count; ++j) {
    const KV* value = v + keys[j] * stride + c;
    V values[WIDTH];
    for (int w = 0; w < WIDTH; ++w) values[w] = Simd::load(value + w * Simd::W);
    for (int h = 0; h < H; ++h) {
      const V weight = Simd::set1(weights[h * weight_stride + j]);
      for (int w = 0; w < WIDTH; ++w) acc[h][w] = Simd::fma(weight, values[w], acc[h][w]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int w = 0; w < WIDTH; ++w) Simd::store(out[h] + c + w * Simd::W, Simd::mul(acc[h][w], norm[h]));
}

// weighted_values for features [begin, end) of the outputs, as many vectors of each head's output per pass over the
// values as the registers hold beside the loaded values and the weight (a 64-wide head's row in one pass with 32
// registers, half of it with 16).
template <class Simd, int H, class KV>
inline void weighted_rows(const KV* v, int64_t stride, const int* keys, int count, const float* weights,
                          int64_t weight_stride, const typename Simd::V* norm, float* const* out, int begin, int end) {
  constexpr int sums = (Simd::registers - 8) / H;
  constexpr int widest = sums >= 8 ? 8 : sums >= 4 ? 4 : sums >= 2 ? 2 : 1;
  int c = begin;
  if constexpr (widest >= 8)
    for (; c + 8 * Simd::W <= end; c += 8 * Simd::W)
      weighted_values<Simd, H, 8>(v, stride, keys, count, weights, weight_stride, norm, out, c);
  if constexpr (widest >= 4)
    for (; c + 4 * Simd::W <= end; c += 4 * Simd::W)
      weighted_values<Simd, H, 4>(v, stride, keys, count, weights, weight_stride, norm, out, c);
  if constexpr (widest >= 2)
    for (; c + 2 * Simd::W <= end; c += 2 * Simd::W)
      weighted_values<Simd, H, 2>(v, stride, keys, count, weights, weight_stride, norm, out, c);
  for (; c < end; c += Simd::W) weighted_values<Simd, H, 1>(v, stride, keys, count, weights, weight_stride, norm, out, c);
}

// KV: the type keys and values are held in (float, or Half widened as it is read).
template <class Simd, int H, class KV>
void attend_heads(const Attention& a, int row, int head, int query_begin, int query_end, const KeySegment& segment) {
  using V = typename Simd::V;
  const int D = a.head_dim, past = a.keys - a.queries, kv_head = head / (a.heads / a.kv_heads);
  const KV* k = static_cast<const KV*>(a.k) + row * a.k_strides[0] + kv_head * a.k_strides[1];
  const KV* v = static_cast<const KV*>(a.v) + row * a.v_strides[0] + kv_head * a.v_strides[1];
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
    int64_t at[H];
    const int count = visible_keys<H>(a, segment, row, head, i, past + i + 1, shown_keys.data(), at);
    if (count == 0) continue;  // it sees none of the keys: visible_keys wrote its zeros
    float* out[H];
    for (int h = 0; h < H; ++h) out[h] = segment.out + at[h] * D;
    dots<Simd, H, KV>(queries.data(), k, a.k_strides[2], shown_keys.data(), count, D, scores.data(), a.keys);
    V norm[H];
    for (int h = 0; h < H; ++h) {
      float* p = scores.data() + static_cast<int64_t>(h) * a.keys;
      const float top = top_of(p, count);
      for (int j = 0; j < count; ++j) p[j] = exp_clamped(p[j] - top);  // vectorized (-fno-trapping-math)
      V sum = Simd::zero();
      int j = 0;
      for (; j + Simd::W <= count; j += Simd::W) sum = Simd::add(sum, Simd::load(p + j));
      float total = Simd::sum(sum);
      for (; j < count; ++j) total += p[j];
      norm[h] = Simd::set1(value_factor(segment, at[h], top, total));
    }
    weighted_rows<Simd, H>(v, a.v_strides[2], shown_keys.data(), count, scores.data(), a.keys, norm, out, 0, D);
  }
}

// f.template operator()<H>() for H = `heads` (1 to kHeadsTogether): the head count a constant, so that each count's
// sums stay in registers.
template <class F>
inline void with_heads(int heads, const F& f) {
  switch (heads) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    default: return f.template operator()<4>();
  }
}

template <class Simd, class KV>
void attend_queries_of(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                       const KeySegment& segment) {
  with_heads(heads, [&]<int H>() { attend_heads<Simd, H, KV>(a, row, head, query_begin, query_end, segment); });
}

// `heads` (at most kHeadsTogether) heads of one kv head from `head`.
template <class Simd>
void attend_queries(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                    const KeySegment& segment) {
  if (a.half_kv) attend_queries_of<Simd, Half>(a, row, head, heads, query_begin, query_end, segment);
  else attend_queries_of<Simd, float>(a, row, head, heads, query_begin, query_end, segment);
}

// The codes, scales and biases of kv head `kv_head` of batch row `row`.
inline std::tuple<const uint8_t*, const float*, const float*> head_rows(const QuantizedRows& r, int row, int kv_head) {
  return {r.codes + row * r.code_strides[0] + kv_head * r.code_strides[1],
          r.scales + row * r.group_strides[0] + kv_head * r.group_strides[1],
          r.biases + row * r.group_strides[0] + kv_head * r.group_strides[1]};
}

// Queries [query_begin, query_end) of H heads sharing one kv head, over 8-bit keys and values: with codes c, scales s
// and biases b of each group of G features of a key's or value's row, and q's sum over the group,
//
//   q . k_j = sum_g s_jg (q_g . c_jg) + b_jg sum(q_g)      sum_j p_j v_jg = sum_j (p_j s_jg) c_jg + sum_j p_j b_jg
//
// each product computed as the float attention computes q . k_j and sum_j p_j v_j (`dots`, `weighted_rows`), the
// codes widened to floats as they are read.
template <class Simd, int H>
void attend_bytes_heads(const QuantizedAttention& a, int row, int head, int query_begin, int query_end,
                        const KeySegment& segment) {
  using V = typename Simd::V;
  const int D = a.head_dim, G = a.group_size, groups = D / G, past = a.keys - a.queries;
  const int kv_head = head / (a.heads / a.kv_heads);
  const auto [k_codes, k_scales, k_biases] = head_rows(a.k, row, kv_head);
  const auto [v_codes, v_scales, v_biases] = head_rows(a.v, row, kv_head);
  const int64_t k_step = a.k.code_strides[2], kg_step = a.k.group_strides[2];
  const int64_t v_step = a.v.code_strides[2], vg_step = a.v.group_strides[2];
  thread_local std::vector<float> scores, products, weights, queries, scales, biases;
  thread_local std::vector<int> shown_keys;
  for (auto* buffer : {&scores, &products, &weights}) buffer->resize(static_cast<size_t>(H) * a.keys);
  for (auto* buffer : {&scales, &biases}) buffer->resize(a.keys);
  shown_keys.resize(a.keys);
  queries.resize(static_cast<size_t>(H) * G);
  for (int i = query_begin; i < query_end; ++i) {
    int64_t at[H];
    const int count = visible_keys<H>(a, segment, row, head, i, past + i + 1, shown_keys.data(), at);
    if (count == 0) continue;  // it sees none of the keys: visible_keys wrote its zeros
    const int* keys = shown_keys.data();
    // The shown keys' (or values') scales and biases of group g side by side, read once for the H heads: where they
    // already are so (one group a row, keys in a run: a decode step's), else gathered.
    const bool run = keys[count - 1] - keys[0] == count - 1;
    auto gather = [&](const float* key_scales, const float* key_biases, int64_t step, int g) {
      if (run && step == 1) return std::pair{key_scales + keys[0], key_biases + keys[0]};
      for (int j = 0; j < count; ++j) {
        scales[j] = key_scales[keys[j] * step + g];
        biases[j] = key_biases[keys[j] * step + g];
      }
      return std::pair<const float*, const float*>{scales.data(), biases.data()};
    };
    float* out[H];
    for (int h = 0; h < H; ++h) out[h] = segment.out + at[h] * D;
    for (int g = 0; g < groups; ++g) {
      float query_sums[H];
      for (int h = 0; h < H; ++h) {
        const float* q = a.q + row * a.q_strides[0] + (head + h) * a.q_strides[1] + i * a.q_strides[2] + g * G;
        query_sums[h] = 0.0f;
        for (int d = 0; d < G; ++d) query_sums[h] += queries[h * G + d] = q[d] * a.scale;
      }
      dots<Simd, H, uint8_t>(queries.data(), k_codes + g * G, k_step, keys, count, G, products.data(), a.keys);
      const auto [key_scales, key_biases] = gather(k_scales, k_biases, kg_step, g);
      for (int h = 0; h < H; ++h) {
        float* s = scores.data() + static_cast<int64_t>(h) * a.keys;
        const float* product = products.data() + static_cast<int64_t>(h) * a.keys;
        const float sum = query_sums[h];
        if (g == 0)
          for (int j = 0; j < count; ++j) s[j] = key_scales[j] * product[j] + key_biases[j] * sum;
        else
          for (int j = 0; j < count; ++j) s[j] += key_scales[j] * product[j] + key_biases[j] * sum;
      }
    }
    V norm[H];
    float factor[H];
    for (int h = 0; h < H; ++h) {
      float* p = scores.data() + static_cast<int64_t>(h) * a.keys;
      const float top = top_of(p, count);
      for (int j = 0; j < count; ++j) p[j] = exp_clamped(p[j] - top);  // vectorized (-fno-trapping-math)
      factor[h] = value_factor(segment, at[h], top, sum_of(p, count));
      norm[h] = Simd::set1(factor[h]);
    }
    for (int g = 0; g < groups; ++g) {
      const auto [value_scales, value_biases] = gather(v_scales, v_biases, vg_step, g);
      float bias[H];
      for (int h = 0; h < H; ++h) {
        const float* p = scores.data() + static_cast<int64_t>(h) * a.keys;
        float* w = weights.data() + static_cast<int64_t>(h) * a.keys;
        for (int j = 0; j < count; ++j) w[j] = p[j] * value_scales[j];
        bias[h] = dot_of(p, value_biases, count) * factor[h];
      }
      weighted_rows<Simd, H>(v_codes, v_step, keys, count, weights.data(), a.keys, norm, out, g * G, (g + 1) * G);
      for (int h = 0; h < H; ++h)
        for (int d = g * G; d < (g + 1) * G; ++d) out[h][d] += bias[h];
    }
  }
}

// Where feature t of a chunk of 32 4-bit codes lies in the chunk's unpacked order: the low nibbles (features 0, 2,
// ..., 30) then the high nibbles (1, 3, ..., 31), as kernel.h's weights unpack.
inline int unpacked_index(int t) { return t % 2 * 16 + t / 2; }

// Queries [query_begin, query_end) of H heads sharing one kv head, over 4-bit keys and values. With codes c,
// scales s and biases b of a key's groups, and q's sum over each group,
//
//   q . k_j = sum_g s_jg (q_g . c_jg) + b_jg sum(q_g)      sum_j p_j v_j = sum_j (p_j s_jg) c_jg + sum_j p_j b_jg
//
// so the codes are only converted to floats, never dequantized: q is laid out in the codes' unpacked order, and
// the output is put back in order at the end of each chunk.
template <class Simd, int H>
void attend_nibbles_heads(const QuantizedAttention& a, int row, int head, int query_begin, int query_end,
                            const KeySegment& segment) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;  // vectors per chunk of 32 features
  constexpr int KB = 4;  // keys scored side by side (Simd::sum4 adds up their four sums at once)
  constexpr int CPP = H * 2 * VPC + 2 * VPC + 1 <= Simd::registers ? 2 : 1;  // chunks per pass over the values
  constexpr int kChunkBytes = 16;  // 32 codes of 4 bits
  const int D = a.head_dim, G = a.group_size, groups = D / G, chunks = D / 32, past = a.keys - a.queries;
  const int kv_head = head / (a.heads / a.kv_heads);
  const auto [k_codes, k_scales, k_biases] = head_rows(a.k, row, kv_head);
  const auto [v_codes, v_scales, v_biases] = head_rows(a.v, row, kv_head);
  const int64_t k_step = a.k.code_strides[2], kg_step = a.k.group_strides[2];
  const int64_t v_step = a.v.code_strides[2], vg_step = a.v.group_strides[2];
  thread_local std::vector<float> scores, queries, query_sums, value_biases;
  thread_local std::vector<int> shown_keys;
  const int64_t score_stride = a.keys + KB;  // room for the scores of a last group of KB keys
  scores.resize(H * score_stride);
  shown_keys.resize(a.keys + KB);
  queries.resize(static_cast<size_t>(H) * D);
  query_sums.resize(static_cast<size_t>(H) * groups);
  value_biases.resize(static_cast<size_t>(H) * groups);
  for (int i = query_begin; i < query_end; ++i) {
    for (int h = 0; h < H; ++h) {
      const float* q = a.q + row * a.q_strides[0] + (head + h) * a.q_strides[1] + i * a.q_strides[2];
      for (int d = 0; d < D; ++d) queries[h * D + d / 32 * 32 + unpacked_index(d % 32)] = q[d] * a.scale;
      for (int g = 0; g < groups; ++g) {
        float sum = 0.0f;
        for (int d = g * G; d < (g + 1) * G; ++d) sum += q[d];
        query_sums[h * groups + g] = sum * a.scale;
      }
    }
    int64_t at[H];
    const int count = visible_keys<H>(a, segment, row, head, i, past + i + 1, shown_keys.data(), at);
    if (count == 0) continue;  // it sees none of the keys: visible_keys wrote its zeros
    float* out[H];
    for (int h = 0; h < H; ++h) out[h] = segment.out + at[h] * D;
    for (int j = count; j % KB; ++j) shown_keys[j] = shown_keys[count - 1];  // a whole last group of KB keys
    for (int j = 0; j < count; j += KB) {
      float total[H][KB] = {};
      for (int g = 0; g < groups; ++g) {
        V acc[H][KB];
        for (int h = 0; h < H; ++h)
          for (int r = 0; r < KB; ++r) acc[h][r] = Simd::zero();
        for (int r = 0; r < KB; ++r) {
          const uint8_t* codes = k_codes + shown_keys[j + r] * k_step;
          for (int c = g * G / 32; c < (g + 1) * G / 32; ++c) {
            V code[VPC];
            Simd::unpack4(codes + c * kChunkBytes, code);
            for (int h = 0; h < H; ++h)
              for (int w = 0; w < VPC; ++w)
                acc[h][r] = Simd::fma(code[w], Simd::load(queries.data() + h * D + c * 32 + w * Simd::W), acc[h][r]);
          }
        }
        for (int h = 0; h < H; ++h) {
          float sums[KB];
          Simd::sum4(acc[h], sums);
          for (int r = 0; r < KB; ++r) {
            const int64_t at = shown_keys[j + r] * kg_step + g;
            total[h][r] += k_scales[at] * sums[r] + k_biases[at] * query_sums[h * groups + g];
          }
        }
      }
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < KB; ++r) scores[h * score_stride + j + r] = total[h][r];
    }
    float norm[H];
    for (int h = 0; h < H; ++h) {
      float* p = scores.data() + h * score_stride;
      const float top = top_of(p, count);
      for (int j = 0; j < count; ++j) p[j] = exp_clamped(p[j] - top);  // vectorized (-fno-trapping-math)
      norm[h] = value_factor(segment, at[h], top, sum_of(p, count));
      for (int g = 0; g < groups; ++g) {
        float bias[kLanes] = {};
        int j = 0;
        for (; j + kLanes <= count; j += kLanes)
          for (int l = 0; l < kLanes; ++l) bias[l] += p[j + l] * v_biases[shown_keys[j + l] * vg_step + g];
        for (; j < count; ++j) bias[0] += p[j] * v_biases[shown_keys[j] * vg_step + g];
        value_biases[h * groups + g] = sum_of(bias, kLanes);
      }
    }
    for (int c0 = 0; c0 < chunks; c0 += CPP) {
      const int passed = std::min(CPP, chunks - c0);
      V acc[H][CPP * VPC];
      for (int h = 0; h < H; ++h)
        for (int w = 0; w < CPP * VPC; ++w) acc[h][w] = Simd::zero();
      for (int j = 0; j < count; ++j) {
        const int key = shown_keys[j];
        const uint8_t* codes = v_codes + key * v_step;
        for (int c = 0; c < passed; ++c) {
          V code[VPC];
          Simd::unpack4(codes + (c0 + c) * kChunkBytes, code);
          const float scale = v_scales[key * vg_step + (c0 + c) * 32 / G];
          for (int h = 0; h < H; ++h) {
            const V weight = Simd::set1(scores[h * score_stride + j] * scale);
            for (int w = 0; w < VPC; ++w) acc[h][c * VPC + w] = Simd::fma(weight, code[w], acc[h][c * VPC + w]);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        alignas(64) float sums[CPP * 32];
        for (int w = 0; w < passed * VPC; ++w) Simd::store(sums + w * Simd::W, acc[h][w]);
        for (int c = 0; c < passed; ++c) {
          const int first = (c0 + c) * 32;
          const float bias = value_biases[h * groups + first / G];
          for (int t = 0; t < 32; ++t) out[h][first + t] = (sums[c * 32 + unpacked_index(t)] + bias) * norm[h];
        }
      }
    }
  }
}

// `heads` (at most kHeadsTogether) heads of one kv head from `head`, over quantized keys and values.
template <class Simd>
void attend_quantized_queries(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                              int query_end, const KeySegment& segment) {
  with_heads(heads, [&]<int H>() {
    if (a.bits == 4) attend_nibbles_heads<Simd, H>(a, row, head, query_begin, query_end, segment);
    else attend_bytes_heads<Simd, H>(a, row, head, query_begin, query_end, segment);
  });
}

}  // namespace minimlx_native
