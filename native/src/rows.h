// The row loop shared by every instruction set; `Simd` supplies vectors of `Simd::W` floats and
// the unpacking of one chunk of 32 packed values into 32 / W float vectors.
#pragma once

#include "kernel.h"

namespace minimlx_native {

template <class Simd, int BITS, int MB>
inline void row_block(const Problem& p, int n, int m0) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;         // vectors per chunk of 32 values
  constexpr int A = MB == 1 ? VPC : 1;      // independent accumulators per input row
  const int groups = p.K / p.group_size, chunks = p.group_size / 32;
  const uint8_t* w = p.w + static_cast<int64_t>(n) * p.K * BITS / 8;
  const float* scales = p.scales + static_cast<int64_t>(n) * groups;
  const float* biases = p.biases + static_cast<int64_t>(n) * groups;
  V acc[MB][A];
  for (int m = 0; m < MB; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = Simd::zero();
  for (int g = 0; g < groups; ++g) {
    V part[MB][A];
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < A; ++a) part[m][a] = Simd::zero();
    for (int c = 0; c < chunks; ++c) {
      const int k = g * p.group_size + c * 32;
      V q[VPC];
      if constexpr (BITS == 4) Simd::unpack4(w + k / 2, q);
      else Simd::unpack8(w + k, q);
      for (int m = 0; m < MB; ++m) {
        const float* x = p.x + static_cast<int64_t>(m0 + m) * p.K + k;
        for (int v = 0; v < VPC; ++v) part[m][v % A] = Simd::fma(q[v], Simd::load(x + v * Simd::W), part[m][v % A]);
      }
    }
    const V scale = Simd::set1(scales[g]);
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = Simd::fma(part[m][a], scale, acc[m][a]);
  }
  for (int m = 0; m < MB; ++m) {
    V total = acc[m][0];
    for (int a = 1; a < A; ++a) total = Simd::add(total, acc[m][a]);
    const float* xsum = p.xsum + static_cast<int64_t>(m0 + m) * groups;
    int g = 0;
    for (; g + Simd::W <= groups; g += Simd::W) total = Simd::fma(Simd::load(biases + g), Simd::load(xsum + g), total);
    float offset = 0.0f;
    for (; g < groups; ++g) offset += biases[g] * xsum[g];
    p.out[static_cast<int64_t>(m0 + m) * p.N + n] = Simd::sum(total) + offset;
  }
}

// Input rows in blocks of up to 4 (each unpacked weight chunk feeds 4 products), each block swept over
// the output rows: a caller's rows are few enough that their packed weights stay in L1 meanwhile.
template <class Simd, int BITS>
inline void rows_bits(const Problem& p, int row_begin, int row_end) {
  int m = 0;
  for (; m + 4 <= p.M; m += 4)
    for (int n = row_begin; n < row_end; ++n) row_block<Simd, BITS, 4>(p, n, m);
  for (int n = row_begin; n < row_end; ++n) {
    switch (p.M - m) {
      case 3: row_block<Simd, BITS, 3>(p, n, m); break;
      case 2: row_block<Simd, BITS, 2>(p, n, m); break;
      case 1: row_block<Simd, BITS, 1>(p, n, m); break;
      default: break;
    }
  }
}

template <class Simd>
inline void rows(const Problem& p, int row_begin, int row_end) {
  if (p.bits == 4) rows_bits<Simd, 4>(p, row_begin, row_end);
  else rows_bits<Simd, 8>(p, row_begin, row_end);
}

}  // namespace minimlx_native
