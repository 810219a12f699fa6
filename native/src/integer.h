// Integer products for a few input rows (decode steps), shared by every instruction set.
//
// The inputs are quantized per block of 32 values as llama.cpp's Q8 activations are (`quantize_inputs`):
// x ~ d * xq with xq = round(x / d) in -127..127 and d = max |x| / 127. With the weight's w = s * q + b per
// group (whole blocks, since groups are multiples of 32),
//
//   out[m, n] = sum_blocks s_g d_b sum_k q[n, k] xq[m, k]  +  sum_g b_g xsum[m, g],  xsum[m, g] = sum_b d_b sum_k xq[m, k]
//
// so the inner sums are dot products of unsigned codes and signed bytes, which one instruction computes four at a
// time per lane (vpdpbusd, maddubs, sdot). A step is as many codes as one vector load holds; its codes are unpacked
// once and dotted with each input row's in turn, and each lane's sum (of one block) is scaled by s_g d_b as it is,
// with no sum across lanes before the end of the row. `Simd` supplies vectors of W floats; `Dot` the integer step
// of an instruction set, for codes of BITS bits:
//
//   span<BITS>         values per step, a multiple of 32; the W lanes of its sums are split evenly between its
//                      blocks, in order
//   codes<BITS>(p)     the step's codes from its packed bytes; partial<BITS>(p, bytes) from its first `bytes`, zeros
//                      past them (a row's last values, where they fill part of a step; spans of 32 never need it)
//   dot<BITS>(c, xq)   the step's partial sums of (q - offset<BITS>) * xq as W floats (exact integers). 4-bit codes
//                      meet the inputs in nibble order: the step's low nibbles (its values 0, 2, 4, ...), then its
//                      high nibbles (1, 3, 5, ...), which is how `quantize_inputs` lays out the inputs for them
//   spread<N>(s)       W floats holding N consecutive scales s[0 .. N) (float, or Half), each in W / N lanes in turn;
//                      spread<N>(s, count) reads only the first `count` of them (for a partial step)
//   offset<BITS>       0 where the codes enter as they are; 128 where 8-bit codes are recentred to fit a signed
//                      byte, whose share, 128 sum_g s_g xsum[m, g], is added back with the biases'
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel.h"
#include "rows.h"

namespace minimlx_native {

// A block gets a second part where its largest value is more than this many times the row's median block's: such a
// block's step d is set by a few outliers (the channels a norm's weight or the residual stream makes large), and its
// other values keep only a few bits. On SmolLM2 about one block in four gets one; greedy decoding then agrees with
// float32 inputs at 99.5% of 2,048 teacher-forced steps instead of 97.9%, for about 2% of the decode speed (2.0 times
// the median: 99.2%; benchmarks/integer_products.py).
constexpr float kSecondPart = 1.5f;

// quantize_inputs (kernel.h), with `Block::largest(x)` the largest |x| of the 32 values of one block and
// `Block::quantize<NIBBLES>(x, d, first, second)` quantizing them: d set, the codes written to first[0 .. 32) in order
// or, NIBBLES, the even values' to first[0 .. 16) and the odd values' to second[0 .. 16) (where nibble order puts
// them), their sum returned. What a block's first part leaves,
// x - d round(x / d), is computed with one rounding (fma) in every instruction set, so each gives the same codes.
template <class Block>
void quantize_rows(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                   const QuantizedInputs& out) {
  const int stride = quantized_stride(K, span), lanes_per_block = lanes * 32 / span, groups = K / group_size;
  const int steps = stride / span, blocks = K / 32;
  thread_local std::vector<float> largest, sorted;
  largest.resize(blocks);
  for (int m = 0; m < M; ++m) {
    const float* row = x + static_cast<int64_t>(m) * K;
    float* sums = out.xsum + static_cast<int64_t>(m) * groups;
    uint8_t* parts = out.parts + static_cast<int64_t>(m) * steps;
    std::fill(sums, sums + groups, 0.0f);
    std::fill(parts, parts + steps, 0);
    for (int b = 0; b < blocks; ++b) largest[b] = Block::largest(row + 32 * b);
    sorted.assign(largest.begin(), largest.end());
    std::nth_element(sorted.begin(), sorted.begin() + blocks / 2, sorted.end());
    const float threshold = kSecondPart * sorted[blocks / 2];
    // block k / 32 is block j of step t, and of group g (counted along rather than divided out)
    for (int k = 0, t = 0, j = 0, g = 0, in_group = 0; k < stride; k += 32) {
      const int64_t at = static_cast<int64_t>(m) * stride + t * span + (nibbles ? 16 : 32) * j;
      const int64_t lane = (static_cast<int64_t>(m) * stride + k) / 32 * lanes_per_block;
      float d = 0.0f, d2 = 0.0f;
      const bool second = k < K && largest[k / 32] > threshold;
      auto zeros = [&](int8_t* codes) {
        std::fill(codes, codes + (nibbles ? 16 : 32), 0);
        if (nibbles) std::fill(codes + span / 2, codes + span / 2 + 16, 0);
      };
      if (k >= K) zeros(out.xq + at);  // padding to a whole step
      if (!second) zeros(out.xq2 + at);
      if (k < K) {
        auto quantize = [&](const float* values, float& scale, int8_t* codes) {
          const int total = nibbles ? Block::template quantize<true>(values, scale, codes, codes + span / 2)
                                    : Block::template quantize<false>(values, scale, codes, codes + span / 2);
          sums[g] += scale * static_cast<float>(total);
        };
        quantize(row + k, d, out.xq + at);
        if (second) {
          float rest[32];
          const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
          for (int i = 0; i < 32; ++i) rest[i] = std::fma(-d, std::nearbyint(row[k + i] * inverse), row[k + i]);
          quantize(rest, d2, out.xq2 + at);
          parts[t] = 1;
        }
      }
      std::fill(out.xd + lane, out.xd + lane + lanes_per_block, d);
      std::fill(out.xd2 + lane, out.xd2 + lane + lanes_per_block, d2);
      if (++j == span / 32) j = 0, ++t;
      if (++in_group == group_size / 32) in_group = 0, ++g;
    }
  }
}

// The W lanes of step t's scales: the step's groups in turn where the group size GS is known (a step of SPAN
// values holds SPAN / GS groups, or lies in one), else each block's looked up.
template <class Dot, class S, int SPAN, int GS>
inline auto step_scales(const S* scales, int t, int group_size) {
  if constexpr (GS != 0) {
    constexpr int N = GS < SPAN ? SPAN / GS : 1;
    return Dot::template spread<N>(scales + static_cast<int64_t>(t) * SPAN / GS);
  } else {
    float s[SPAN / 32];
    for (int j = 0; j < SPAN / 32; ++j) s[j] = static_cast<float>(scales[(t * SPAN + 32 * j) / group_size]);
    return Dot::template spread<SPAN / 32>(s);
  }
}

// The same for a last step t of only `rest` values, reading no scales past them (the lanes past them get zeros, or
// the last group's scale, whose codes are zeros).
template <class Dot, class S, int SPAN, int GS>
inline auto partial_scales(const S* scales, int t, int rest, int group_size) {
  if constexpr (GS != 0) {
    constexpr int N = GS < SPAN ? SPAN / GS : 1;
    return Dot::template spread<N>(scales + static_cast<int64_t>(t) * SPAN / GS, (rest + GS - 1) / GS);
  } else {
    float s[SPAN / 32];
    for (int j = 0; j < SPAN / 32; ++j) s[j] = static_cast<float>(scales[(t * SPAN + std::min(32 * j, rest - 32)) / group_size]);
    return Dot::template spread<SPAN / 32>(s);
  }
}

// Step t of MB input rows from m0, for the codes of one output row and their scales spread over the step's
// blocks, into acc.
template <class Simd, class Dot, int BITS, int MB, class Codes>
inline void integer_step(const Problem& p, const Codes& codes, typename Simd::V scale, int m0, int t,
                         typename Simd::V* acc) {
  constexpr int SPAN = Dot::template span<BITS>;
  const int64_t stride = p.xq_stride, steps = stride / SPAN;
  for (int m = 0; m < MB; ++m) {
    const int64_t row = m0 + m, at = row * stride + t * SPAN, lanes = (row * steps + t) * Simd::W;
    typename Simd::V part = Simd::mul(Dot::template dot<BITS>(codes, p.xq + at), Simd::load(p.xd + lanes));
    if (p.parts[row * steps + t])  // the same steps for every output row: a branch the CPU predicts
      part = Simd::fma(Dot::template dot<BITS>(codes, p.xq2 + at), Simd::load(p.xd2 + lanes), part);
    acc[m] = Simd::fma(part, scale, acc[m]);
  }
}

// Output rows [row_begin, row_end) for MB input rows from m0, one at a time. Each row's sums run in the same order
// whatever MB is and wherever the range begins (the last sums across lanes take four output rows' vectors at a
// time, each summed alone), so that a row's result does not depend on the rows computed beside it (a batch gives
// each sequence what it gets alone).
template <class Simd, class Dot, class S, int BITS, int GS, int MB>
void integer_block(const Problem& p, int row_begin, int row_end, int m0) {
  using V = typename Simd::V;
  constexpr int SPAN = Dot::template span<BITS>, STEP_BYTES = SPAN * BITS / 8;
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size, steps = p.K / SPAN;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  V totals[MB][4];
  float rests[MB][4];
  const int ahead = rows_ahead(row_bytes);
  for (int n = row_begin; n < row_end; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * groups;
    const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * groups;
    if (n + ahead < row_end) prefetch_row(w, scales, biases, row_bytes, groups, ahead);
    // Even and odd steps (and a partial last one) in two chains of FMAs, where one would wait on each FMA before
    // the next; unrolled by two, so that each chain's sums stay in registers.
    V even[MB], odd[MB];
    for (int m = 0; m < MB; ++m) even[m] = odd[m] = Simd::zero();
    auto step = [&](int t, V* acc) {
      const V scale = step_scales<Dot, S, SPAN, GS>(scales, t, group_size);
      integer_step<Simd, Dot, BITS, MB>(p, Dot::template codes<BITS>(w + t * STEP_BYTES), scale, m0, t, acc);
    };
    int t = 0;
    for (; t + 1 < steps; t += 2) {
      step(t, even);
      step(t + 1, odd);
    }
    if (t < steps) step(t, even);
    if constexpr (SPAN > 32) {
      if (const int rest = p.K - steps * SPAN; rest > 0) {  // the row's last values fill part of a step: zero codes
        const auto codes = Dot::template partial<BITS>(w + steps * STEP_BYTES, rest * BITS / 8);
        const V scale = partial_scales<Dot, S, SPAN, GS>(scales, steps, rest, group_size);
        integer_step<Simd, Dot, BITS, MB>(p, codes, scale, m0, steps, odd);
      }
    }
    const int slot = (n - row_begin) % 4;
    for (int m = 0; m < MB; ++m) {
      const float* xsum = p.xsum + static_cast<int64_t>(m0 + m) * groups;
      float& rest = rests[m][slot] = 0.0f;
      V total = bias_terms<Simd, S>(biases, xsum, groups, Simd::add(even[m], odd[m]), rest);
      if constexpr (Dot::template offset<BITS> != 0) {
        float offset_rest = 0.0f;
        const V offset_total = bias_terms<Simd, S>(scales, xsum, groups, Simd::zero(), offset_rest);
        total = Simd::fma(offset_total, Simd::set1(Dot::template offset<BITS>), total);
        rest += Dot::template offset<BITS> * offset_rest;
      }
      totals[m][slot] = total;
    }
    if (slot == 3 || n + 1 == row_end) {
      for (int m = 0; m < MB; ++m) {
        for (int r = slot + 1; r < 4; ++r) totals[m][r] = Simd::zero();
        float sums[4];
        Simd::sum4(totals[m], sums);
        for (int r = 0; r <= slot; ++r) p.out[static_cast<int64_t>(m0 + m) * p.N + n - slot + r] = sums[r] + rests[m][r];
      }
    }
  }
}

// Output rows [row_begin, row_end) for every input row: blocks of 8 where the vector registers hold their sums (16
// of 32), then of 4, then the last 1-3, the output rows read once per block.
template <class Simd, class Dot, class S, int BITS, int GS>
inline void integer_rows_bits(const Problem& p, int row_begin, int row_end) {
  int m = 0;
  if constexpr (Simd::registers >= 32)
    for (; m + 8 <= p.M; m += 8) integer_block<Simd, Dot, S, BITS, GS, 8>(p, row_begin, row_end, m);
  for (; m + 4 <= p.M; m += 4) integer_block<Simd, Dot, S, BITS, GS, 4>(p, row_begin, row_end, m);
  switch (p.M - m) {
    case 3: return integer_block<Simd, Dot, S, BITS, GS, 3>(p, row_begin, row_end, m);
    case 2: return integer_block<Simd, Dot, S, BITS, GS, 2>(p, row_begin, row_end, m);
    case 1: return integer_block<Simd, Dot, S, BITS, GS, 1>(p, row_begin, row_end, m);
    default: return;
  }
}

template <class Simd, class Dot, class S, int BITS>
inline void integer_rows_groups(const Problem& p, int row_begin, int row_end) {
  switch (p.group_size) {
    case 32: return integer_rows_bits<Simd, Dot, S, BITS, 32>(p, row_begin, row_end);
    case 64: return integer_rows_bits<Simd, Dot, S, BITS, 64>(p, row_begin, row_end);
    default: return integer_rows_bits<Simd, Dot, S, BITS, 0>(p, row_begin, row_end);
  }
}

template <class Simd, class Dot, class S>
inline void integer_rows_of(const Problem& p, int row_begin, int row_end) {
  if (p.bits == 4) integer_rows_groups<Simd, Dot, S, 4>(p, row_begin, row_end);
  else integer_rows_groups<Simd, Dot, S, 8>(p, row_begin, row_end);
}

template <class Simd, class Dot>
inline void integer_rows(const Problem& p, int row_begin, int row_end) {
  if (p.half_scales) integer_rows_of<Simd, Dot, Half>(p, row_begin, row_end);
  else integer_rows_of<Simd, Dot, float>(p, row_begin, row_end);
}

}  // namespace minimlx_native
