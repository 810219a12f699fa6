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

// Output rows [row_begin, row_end) (a multiple of NB of them), NB at a time, times MB input rows over groups
// [g_begin, g_end), each weight chunk dequantized once (scale * q + bias) and fed to MB products; the sums
// are added to `out` unless `first`. Past a few input rows the products bound the time: NB * MB independent
// sums keep both FMA pipes busy where the integer sums of `block` (MB sums, each waiting on its last FMA)
// fill half of them.
template <class Simd, int BITS, int GS, int NB, int MB>
inline void dequantized_block(const Problem& p, int row_begin, int row_end, int m0, int g_begin, int g_end, bool first) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size, chunks = group_size / 32;
  const int64_t K = p.K, row_bytes = K * BITS / 8;
  const float* x = p.x + m0 * K;
  for (int n = row_begin; n + NB <= row_end; n += NB) {
    const uint8_t* w = p.w + n * row_bytes;
    const float* scales = p.scales + static_cast<int64_t>(n) * groups;
    const float* biases = p.biases + static_cast<int64_t>(n) * groups;
    V acc[NB][MB];
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = Simd::zero();
    for (int g = g_begin; g < g_end; ++g) {
      V scale[NB], bias[NB];
      for (int r = 0; r < NB; ++r) {
        scale[r] = Simd::set1(scales[r * groups + g]);
        bias[r] = Simd::set1(biases[r * groups + g]);
      }
      for (int c = 0; c < chunks; ++c) {
        const int k = g * group_size + c * 32;
        V wv[NB][VPC];
        for (int r = 0; r < NB; ++r) {
          if constexpr (BITS == 4) Simd::unpack4(w + r * row_bytes + k / 2, wv[r]);
          else Simd::unpack8(w + r * row_bytes + k, wv[r]);
          for (int v = 0; v < VPC; ++v) wv[r][v] = Simd::fma(wv[r][v], scale[r], bias[r]);
        }
        for (int m = 0; m < MB; ++m) {
          V xv[VPC];
          for (int v = 0; v < VPC; ++v) xv[v] = Simd::load(x + m * K + k + v * Simd::W);
          for (int r = 0; r < NB; ++r)
            for (int v = 0; v < VPC; ++v) acc[r][m] = Simd::fma(wv[r][v], xv[v], acc[r][m]);
        }
      }
    }
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) {
        float& out = p.out[(m0 + m) * static_cast<int64_t>(p.N) + n + r];
        out = (first ? 0.0f : out) + Simd::sum(acc[r][m]);
      }
  }
}

// About this many bytes of inputs per pass over the output rows: MB rows of x stay in L1 (32 KB on most
// cores) beside the weights streaming through. 8 rows of K = 1536 (48 KB) ran 1.6x slower than of K = 576.
constexpr int kInputTileBytes = 24 * 1024;

// Input rows [m0, m0 + MB) for output rows [row_begin, row_end), NB at a time, in slices of the groups.
// Not inlined: inside the caller's one big function, GCC 12 stored the sums to the stack on every group
// (8 rows of 1536 x 576 at 4 bits, one core of a Zen 4: 26 GMAC/s inlined, 43 in a function of its own).
template <class Simd, int BITS, int GS, int NB, int MB>
__attribute__((noinline)) void dequantized_rows(const Problem& p, int row_begin, int row_end, int m0) {
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size;
  const int64_t input_bytes = static_cast<int64_t>(MB) * p.K * sizeof(float);
  const int slices = static_cast<int>((input_bytes + kInputTileBytes - 1) / kInputTileBytes);
  const int slice = (groups + slices - 1) / slices;
  const int tail = row_end - (row_end - row_begin) % NB;
  for (int g = 0; g < groups; g += slice) {
    const int g_end = g + slice < groups ? g + slice : groups;
    dequantized_block<Simd, BITS, GS, NB, MB>(p, row_begin, tail, m0, g, g_end, g == 0);
    dequantized_block<Simd, BITS, GS, 1, MB>(p, tail, row_end, m0, g, g_end, g == 0);
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

// Input rows in blocks of 8, then 4, then the rest, each block swept over the caller's output rows (few
// enough that their packed weights stay in L1 meanwhile). In a C++ harness, one core: 8 rows of 1536 x 576
// at 4 bits 280 -> 182 us (39 GMAC/s, of 46 that the core's two FMA pipes can do) on an AVX2 core; 166 us
// (43 GMAC/s, of 58) on a Zen 4 core in AVX-512. Blocks of 8 input rows take two output rows at a time where
// the registers hold their 16 sums, two weight chunks and an input chunk (AVX-512: 32 registers).
template <class Simd, int BITS, int GS>
inline void rows_bits(const Problem& p, int row_begin, int row_end) {
  constexpr int VPC = 32 / Simd::W, NB = 2 * 8 + 3 * VPC <= Simd::registers ? 2 : 1;
  int m = 0;
  for (; m + 8 <= p.M; m += 8) dequantized_rows<Simd, BITS, GS, NB, 8>(p, row_begin, row_end, m);
  if (m + 4 <= p.M) {
    dequantized_rows<Simd, BITS, GS, 2, 4>(p, row_begin, row_end, m);
    m += 4;
  }
  switch (p.M - m) {
    case 3: leftover<Simd, BITS, GS, 3>(p, row_begin, row_end, m); break;
    case 2: leftover<Simd, BITS, GS, 2>(p, row_begin, row_end, m); break;
    case 1: leftover<Simd, BITS, GS, 1>(p, row_begin, row_end, m); break;
    default: break;
  }
}

// Weight rows [row_begin, row_end) as float32 (scale * q + bias, the same FMA as the blocks above), row by row
// into `dst`, each chunk of 32 values in the order the kernel unpacks them (the order `prepare_inputs` gives x).
template <class Simd>
void dequantize_rows(const Problem& p, int row_begin, int row_end, float* dst) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;
  const int groups = p.K / p.group_size, chunks = p.group_size / 32;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * p.bits / 8;
  for (int n = row_begin; n < row_end; ++n, dst += p.K) {
    const uint8_t* w = p.w + n * row_bytes;
    for (int g = 0; g < groups; ++g) {
      const V scale = Simd::set1(p.scales[static_cast<int64_t>(n) * groups + g]);
      const V bias = Simd::set1(p.biases[static_cast<int64_t>(n) * groups + g]);
      for (int c = 0; c < chunks; ++c) {
        const int k = (g * chunks + c) * 32;
        V q[VPC];
        if (p.bits == 4) Simd::unpack4(w + k / 2, q);
        else Simd::unpack8(w + k, q);
        for (int v = 0; v < VPC; ++v) Simd::store(dst + k + v * Simd::W, Simd::fma(q[v], scale, bias));
      }
    }
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
