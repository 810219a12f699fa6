// The row loop shared by every instruction set; `Simd` supplies vectors of `Simd::W` floats and
// the unpacking of one chunk of 32 packed values into 32 / W float vectors.
#pragma once

#include "kernel.h"

namespace minimlx_native {

// sum_g biases[g] * xsum[g], vectorized over groups.
template <class Simd>
inline float bias_term(const float* biases, const float* xsum, int groups) {
  typename Simd::V total = Simd::zero();
  int g = 0;
  for (; g + Simd::W <= groups; g += Simd::W) total = Simd::fma(Simd::load(biases + g), Simd::load(xsum + g), total);
  float rest = 0.0f;
  for (; g < groups; ++g) rest += biases[g] * xsum[g];
  return Simd::sum(total) + rest;
}

// NB output rows from n times MB input rows from m0: each unpacked weight chunk feeds MB products and
// each input chunk NB, so that one input row still has NB independent sums for the CPU to overlap.
template <class Simd, int BITS, int GS, int NB, int MB>
inline void block(const Problem& p, int n, int m0) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;  // vectors per chunk of 32 values
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size, chunks = group_size / 32;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  const float* scales = p.scales + static_cast<int64_t>(n) * groups;
  const float* biases = p.biases + static_cast<int64_t>(n) * groups;
  V acc[NB][MB];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = Simd::zero();
  for (int g = 0; g < groups; ++g) {
    V part[NB][MB];
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) part[r][m] = Simd::zero();
    for (int c = 0; c < chunks; ++c) {
      const int k = g * group_size + c * 32;
      for (int r = 0; r < NB; ++r) {
        V q[VPC];
        if constexpr (BITS == 4) Simd::unpack4(p.w + (n + r) * row_bytes + k / 2, q);
        else Simd::unpack8(p.w + (n + r) * row_bytes + k, q);
        for (int m = 0; m < MB; ++m) {
          const float* x = p.x + static_cast<int64_t>(m0 + m) * p.K + k;
          for (int v = 0; v < VPC; ++v) part[r][m] = Simd::fma(q[v], Simd::load(x + v * Simd::W), part[r][m]);
        }
      }
    }
    for (int r = 0; r < NB; ++r) {
      const V scale = Simd::set1(scales[r * groups + g]);
      for (int m = 0; m < MB; ++m) acc[r][m] = Simd::fma(part[r][m], scale, acc[r][m]);
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) {
      const float* xsum = p.xsum + static_cast<int64_t>(m0 + m) * groups;
      p.out[static_cast<int64_t>(m0 + m) * p.N + n + r] = Simd::sum(acc[r][m]) + bias_term<Simd>(biases + r * groups, xsum, groups);
    }
}

// The last MB (< 4) input rows, 4 / MB output rows at a time.
template <class Simd, int BITS, int GS, int MB>
inline void leftover(const Problem& p, int row_begin, int row_end, int m) {
  constexpr int NB = 4 / MB;
  int n = row_begin;
  for (; n + NB <= row_end; n += NB) block<Simd, BITS, GS, NB, MB>(p, n, m);
  for (; n < row_end; ++n) block<Simd, BITS, GS, 1, MB>(p, n, m);
}

// Input rows in blocks of 4 swept over the output rows: a caller's rows are few enough that their packed
// weights stay in L1 meanwhile.
template <class Simd, int BITS, int GS>
inline void rows_bits(const Problem& p, int row_begin, int row_end) {
  int m = 0;
  for (; m + 4 <= p.M; m += 4)
    for (int n = row_begin; n < row_end; ++n) block<Simd, BITS, GS, 1, 4>(p, n, m);
  switch (p.M - m) {
    case 3: leftover<Simd, BITS, GS, 3>(p, row_begin, row_end, m); break;
    case 2: leftover<Simd, BITS, GS, 2>(p, row_begin, row_end, m); break;
    case 1: leftover<Simd, BITS, GS, 1>(p, row_begin, row_end, m); break;
    default: break;
  }
}

// The group size as a constant where it is a common one (GS = 0: read from `p`): with the chunks per group
// known, the compiler unrolls the group loop and keeps the sums in registers (1.6x at 32, in a C++ harness).
template <class Simd, int BITS>
inline void rows_groups(const Problem& p, int row_begin, int row_end) {
  switch (p.group_size) {
    case 32: return rows_bits<Simd, BITS, 32>(p, row_begin, row_end);
    case 64: return rows_bits<Simd, BITS, 64>(p, row_begin, row_end);
    default: return rows_bits<Simd, BITS, 0>(p, row_begin, row_end);
  }
}

template <class Simd>
inline void rows(const Problem& p, int row_begin, int row_end) {
  if (p.bits == 4) rows_groups<Simd, 4>(p, row_begin, row_end);
  else rows_groups<Simd, 8>(p, row_begin, row_end);
}

}  // namespace minimlx_native
