// The row loop shared by every instruction set; `Simd` supplies vectors of `Simd::W` floats and
// the unpacking of one chunk of 32 packed values into 32 / W float vectors. Each loop is written once for
// scales and biases of type `S` (float, or Half converted as it is read: `Simd::load` of Half widens W of them).
#pragma once

#include "kernel.h"

namespace minimlx_native {

// sum_g biases[g] * xsum[g], vectorized over groups: the vectors' products added to `total`, the groups past the
// last whole vector's to `rest` (for a caller that sums its own vector's lanes with them).
template <class Simd, class S>
inline typename Simd::V bias_terms(const S* biases, const float* xsum, int groups, typename Simd::V total, float& rest) {
  int g = 0;
  for (; g + Simd::W <= groups; g += Simd::W) total = Simd::fma(Simd::load(biases + g), Simd::load(xsum + g), total);
  for (; g < groups; ++g) rest += static_cast<float>(biases[g]) * xsum[g];
  return total;
}

template <class Simd, class S>
inline float bias_term(const S* biases, const float* xsum, int groups) {
  float rest = 0.0f;
  return Simd::sum(bias_terms<Simd, S>(biases, xsum, groups, Simd::zero(), rest)) + rest;
}

// Bytes of packed weights a row loop asks for ahead of the row it computes. With one input row (a decode step) the
// weights stream from memory and the products wait on them, less so when each row asks for the weights about 2 KB
// ahead (nearer and much further were both slower).
constexpr int64_t kPrefetchBytes = 2048;

// Whole rows of `row_bytes` in kPrefetchBytes (at least one).
inline int rows_ahead(int64_t row_bytes) { return static_cast<int>((kPrefetchBytes + row_bytes - 1) / row_bytes); }

// Ask for the codes, scales and biases of the row `ahead` rows after the one at w, scales, biases.
template <class S>
inline void prefetch_row(const uint8_t* w, const S* scales, const S* biases, int64_t row_bytes, int groups, int ahead) {
  const uint8_t* codes = w + ahead * row_bytes;
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(codes + b);
  __builtin_prefetch(scales + static_cast<int64_t>(ahead) * groups);
  __builtin_prefetch(biases + static_cast<int64_t>(ahead) * groups);
}

// Output row n times MB input rows from m0: per group, the packed integers times x summed, then scaled (the
// biases' share comes from x's group sums). Both forms here take one weight row at a time, so that its values
// are read as one stream, which the CPU's prefetcher follows; four rows side by side are four streams a row
// apart, which it follows poorly, and gain nothing in cache.
template <class Simd, class S, int BITS, int GS, int MB>
inline void block(const Problem& p, int n, int m0) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;  // vectors per chunk of 32 values
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size, chunks = group_size / 32;
  const uint8_t* w = p.w + static_cast<int64_t>(n) * p.K * BITS / 8;
  const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * groups;
  const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * groups;
  V acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = Simd::zero();
  for (int g = 0; g < groups; ++g) {
    V part[MB];
    for (int m = 0; m < MB; ++m) part[m] = Simd::zero();
    for (int c = 0; c < chunks; ++c) {
      const int k = g * group_size + c * 32;
      V q[VPC];
      if constexpr (BITS == 4) Simd::unpack4(w + k / 2, q);
      else Simd::unpack8(w + k, q);
      for (int m = 0; m < MB; ++m) {
        const float* x = p.x + static_cast<int64_t>(m0 + m) * p.K + k;
        for (int v = 0; v < VPC; ++v) part[m] = Simd::fma(q[v], Simd::load(x + v * Simd::W), part[m]);
      }
    }
    const V scale = Simd::set1(static_cast<float>(scales[g]));
    for (int m = 0; m < MB; ++m) acc[m] = Simd::fma(part[m], scale, acc[m]);
  }
  for (int m = 0; m < MB; ++m) {
    const float* xsum = p.xsum + static_cast<int64_t>(m0 + m) * groups;
    p.out[static_cast<int64_t>(m0 + m) * p.N + n] = Simd::sum(acc[m]) + bias_term<Simd, S>(biases, xsum, groups);
  }
}

// Output rows [row_begin, row_end), one at a time, times MB input rows over groups [g_begin, g_end), each weight
// chunk dequantized once (scale * q + bias) and fed to MB products; the sums are added to `out` unless `first`.
// Past a few input rows the products bound the time: MB independent sums keep both FMA pipes busy where the
// integer sums of `block` (each waiting on its last FMA) fill half of them. One weight row at a time, as in
// `block`: two at a time (each input load feeding two FMAs) measured slower, in cache as well as from memory.
template <class Simd, class S, int BITS, int GS, int MB>
inline void dequantized_block(const Problem& p, int row_begin, int row_end, int m0, int g_begin, int g_end, bool first) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size, chunks = group_size / 32;
  const int64_t K = p.K, row_bytes = K * BITS / 8;
  const float* x = p.x + m0 * K;
  for (int n = row_begin; n < row_end; ++n) {
    const uint8_t* w = p.w + n * row_bytes;
    const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * groups;
    const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * groups;
    V acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = Simd::zero();
    for (int g = g_begin; g < g_end; ++g) {
      const V scale = Simd::set1(static_cast<float>(scales[g])), bias = Simd::set1(static_cast<float>(biases[g]));
      for (int c = 0; c < chunks; ++c) {
        const int k = g * group_size + c * 32;
        V wv[VPC];
        if constexpr (BITS == 4) Simd::unpack4(w + k / 2, wv);
        else Simd::unpack8(w + k, wv);
        for (int v = 0; v < VPC; ++v) wv[v] = Simd::fma(wv[v], scale, bias);
        for (int m = 0; m < MB; ++m)
          for (int v = 0; v < VPC; ++v) acc[m] = Simd::fma(wv[v], Simd::load(x + m * K + k + v * Simd::W), acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      float& out = p.out[(m0 + m) * static_cast<int64_t>(p.N) + n];
      out = (first ? 0.0f : out) + Simd::sum(acc[m]);
    }
  }
}

// About this many bytes of inputs per pass over the output rows: MB rows of x stay in L1 (32 KB on most
// cores) beside the weights streaming through; 8 whole rows of K = 1536 (48 KB) would not.
constexpr int kInputTileBytes = 24 * 1024;

// Input rows [m0, m0 + MB) for output rows [row_begin, row_end), in slices of the groups.
// Not inlined: inside the caller's one big function, GCC 12 stored the sums to the stack on every group.
template <class Simd, class S, int BITS, int GS, int MB>
__attribute__((noinline)) void dequantized_rows(const Problem& p, int row_begin, int row_end, int m0) {
  const int group_size = GS ? GS : p.group_size, groups = p.K / group_size;
  const int64_t input_bytes = static_cast<int64_t>(MB) * p.K * sizeof(float);
  const int slices = static_cast<int>((input_bytes + kInputTileBytes - 1) / kInputTileBytes);
  const int slice = (groups + slices - 1) / slices;
  for (int g = 0; g < groups; g += slice)
    dequantized_block<Simd, S, BITS, GS, MB>(p, row_begin, row_end, m0, g, g + slice < groups ? g + slice : groups, g == 0);
}

// Input rows in blocks of 8, then 4, each block swept over the caller's output rows (few enough that their
// packed weights stay in L1 meanwhile), then the last 1-3 through `block`.
template <class Simd, class S, int BITS, int GS>
inline void rows_bits(const Problem& p, int row_begin, int row_end) {
  int m = 0;
  for (; m + 8 <= p.M; m += 8) dequantized_rows<Simd, S, BITS, GS, 8>(p, row_begin, row_end, m);
  if (m + 4 <= p.M) {
    dequantized_rows<Simd, S, BITS, GS, 4>(p, row_begin, row_end, m);
    m += 4;
  }
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  const int groups = p.K / (GS ? GS : p.group_size), ahead = rows_ahead(row_bytes);
  for (int n = row_begin; n < row_end; ++n) {
    if (n + ahead < row_end && m < p.M)
      prefetch_row(p.w + n * row_bytes, static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * groups,
                   static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * groups, row_bytes, groups, ahead);
    switch (p.M - m) {
      case 3: block<Simd, S, BITS, GS, 3>(p, n, m); break;
      case 2: block<Simd, S, BITS, GS, 2>(p, n, m); break;
      case 1: block<Simd, S, BITS, GS, 1>(p, n, m); break;
      default: return;
    }
  }
}

// Weight rows [row_begin, row_end) as float32 (scale * q + bias, the same FMA as the blocks above), row by row
// into `dst`, each chunk of 32 values in the order the kernel unpacks them (the order `prepare_inputs` gives x).
template <class Simd, class S>
void dequantize_rows_of(const Problem& p, int row_begin, int row_end, float* dst) {
  using V = typename Simd::V;
  constexpr int VPC = 32 / Simd::W;
  const int groups = p.K / p.group_size, chunks = p.group_size / 32;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * p.bits / 8;
  for (int n = row_begin; n < row_end; ++n, dst += p.K) {
    const uint8_t* w = p.w + n * row_bytes;
    const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * groups;
    const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * groups;
    for (int g = 0; g < groups; ++g) {
      const V scale = Simd::set1(static_cast<float>(scales[g])), bias = Simd::set1(static_cast<float>(biases[g]));
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
// known, the compiler unrolls the group loop and keeps the sums in registers.
template <class Simd, class S, int BITS>
inline void rows_groups(const Problem& p, int row_begin, int row_end) {
  switch (p.group_size) {
    case 32: return rows_bits<Simd, S, BITS, 32>(p, row_begin, row_end);
    case 64: return rows_bits<Simd, S, BITS, 64>(p, row_begin, row_end);
    default: return rows_bits<Simd, S, BITS, 0>(p, row_begin, row_end);
  }
}

template <class Simd, class S>
inline void rows_of(const Problem& p, int row_begin, int row_end) {
  if (p.bits == 4) rows_groups<Simd, S, 4>(p, row_begin, row_end);
  else rows_groups<Simd, S, 8>(p, row_begin, row_end);
}

template <class Simd>
inline void rows(const Problem& p, int row_begin, int row_end) {
  if (p.half_scales) rows_of<Simd, Half>(p, row_begin, row_end);
  else rows_of<Simd, float>(p, row_begin, row_end);
}

template <class Simd>
void dequantize_rows(const Problem& p, int row_begin, int row_end, float* dst) {
  if (p.half_scales) dequantize_rows_of<Simd, Half>(p, row_begin, row_end, dst);
  else dequantize_rows_of<Simd, float>(p, row_begin, row_end, dst);
}

}  // namespace minimlx_native
