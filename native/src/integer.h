// Integer products for a few input rows (decode steps), shared by every instruction set.
//
// The inputs are quantized per block of 32 values as llama.cpp's Q8 activations are (`quantize_inputs`):
// x ~ d * xq with xq = round(x / d) in -127..127 and d = max |x| / 127. With the weight's w = s * q + b per
// group (whole blocks, since groups are multiples of 32),
//
//   out[m, n] = sum_blocks s_g d_b sum_k q[n, k] xq[m, k]  +  sum_g b_g xsum[m, g],  xsum[m, g] = sum_b d_b sum_k xq[m, k]
//
// so the inner sums are dot products of unsigned codes and signed bytes, which one instruction computes four at a
// time per lane (vpdpbusd, maddubs, sdot). `Simd` supplies vectors of W floats; `Dot` the integer step of an
// instruction set:
//
//   span               values per step, a multiple of 32; the W lanes of its sums are split evenly between its blocks
//   Codes              the codes of one step as unsigned bytes in order, from `codes<BITS>(packed bytes)`
//   dot<BITS>(c, xq)   the step's partial sums of (q - offset<BITS>) * xq as W floats (exact integers)
//   spread(s)          W floats holding s[j] in the lanes of the step's block j
//   offset<BITS>       0 where the codes enter as they are; 128 where 8-bit codes are recentred to fit a signed
//                      byte, whose share, 128 sum_g s_g xsum[m, g], is added back with the biases'
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernel.h"
#include "rows.h"

namespace minimlx_native {

// Step t (values t * span on) of MB input rows from m0, for the codes of one output row and their scales spread
// over the step's blocks, into acc.
template <class Simd, class Dot, int BITS, int MB>
inline void integer_step(const Problem& p, const typename Dot::Codes& codes, typename Simd::V scale, int m0, int t,
                         typename Simd::V* acc) {
  constexpr int SPAN = Dot::span;
  const int64_t stride = p.xq_stride;
  for (int m = 0; m < MB; ++m) {
    const int64_t row = m0 + m;
    const typename Simd::V sums = Dot::template dot<BITS>(codes, p.xq + row * stride + t * SPAN);
    const typename Simd::V block_scales = Simd::load(p.xd + (row * stride / SPAN + t) * Simd::W);
    acc[m] = Simd::fma(Simd::mul(sums, block_scales), scale, acc[m]);
  }
}

// Output row n for MB input rows from m0. Each row's sums run in the same order whatever MB is, so a row's result
// does not depend on the rows computed beside it (a batch gives each sequence what it gets alone).
template <class Simd, class Dot, class S, int BITS, int GS, int MB>
inline void integer_block(const Problem& p, int n, int m0) {
  using V = typename Simd::V;
  constexpr int SPAN = Dot::span, BLOCKS = SPAN / 32, STEP_BYTES = SPAN * BITS / 8;
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size, steps = p.K / SPAN;
  const uint8_t* w = p.w + static_cast<int64_t>(n) * p.K * BITS / 8;
  const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * groups;
  const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * groups;
  V acc[2][MB];  // even and odd steps: two chains of FMAs, where one would wait on each FMA before the next
  for (int m = 0; m < MB; ++m) acc[0][m] = acc[1][m] = Simd::zero();
  float s[BLOCKS];
  for (int t = 0; t < steps; ++t) {
    for (int j = 0; j < BLOCKS; ++j) s[j] = static_cast<float>(scales[(t * SPAN + 32 * j) / group_size]);
    const auto codes = Dot::template codes<BITS>(w + t * STEP_BYTES);
    integer_step<Simd, Dot, BITS, MB>(p, codes, Dot::spread(s), m0, t, acc[t % 2]);
  }
  if (steps * SPAN < p.K) {  // the row's last values fill part of a step: zero codes past them
    alignas(64) uint8_t tail[STEP_BYTES] = {};
    std::memcpy(tail, w + steps * STEP_BYTES, (p.K - steps * SPAN) * BITS / 8);
    for (int j = 0; j < BLOCKS; ++j) s[j] = static_cast<float>(scales[std::min(steps * SPAN + 32 * j, p.K - 32) / group_size]);
    integer_step<Simd, Dot, BITS, MB>(p, Dot::template codes<BITS>(tail), Dot::spread(s), m0, steps, acc[steps % 2]);
  }
  for (int m = 0; m < MB; ++m) {
    const float* xsum = p.xsum + static_cast<int64_t>(m0 + m) * groups;
    float bias = bias_term<Simd, S>(biases, xsum, groups);
    if constexpr (Dot::template offset<BITS> != 0) bias += Dot::template offset<BITS> * bias_term<Simd, S>(scales, xsum, groups);
    p.out[static_cast<int64_t>(m0 + m) * p.N + n] = Simd::sum(Simd::add(acc[0][m], acc[1][m])) + bias;
  }
}

// Output rows [row_begin, row_end) for every input row: blocks of 4, then the last 1-3, each output row read once
// per block.
template <class Simd, class Dot, class S, int BITS, int GS>
inline void integer_rows_bits(const Problem& p, int row_begin, int row_end) {
  int m = 0;
  for (; m + 4 <= p.M; m += 4)
    for (int n = row_begin; n < row_end; ++n) integer_block<Simd, Dot, S, BITS, GS, 4>(p, n, m);
  for (int n = row_begin; n < row_end; ++n) {
    switch (p.M - m) {
      case 3: integer_block<Simd, Dot, S, BITS, GS, 3>(p, n, m); break;
      case 2: integer_block<Simd, Dot, S, BITS, GS, 2>(p, n, m); break;
      case 1: integer_block<Simd, Dot, S, BITS, GS, 1>(p, n, m); break;
      default: return;
    }
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
