// Float32 products out = x @ w.T for many input rows (a prompt's chunk), `Simd` supplying vectors of
// `Simd::W` floats.
//
// The input rows are first packed into panels of 2 * W rows, transposed: panel[k * 2W + i] = x[m0 + i, k].
// A tile of NR weight rows then keeps NR x 2 vector sums of 2W outputs each: at every k it loads the panel's
// two vectors and multiplies them by each weight row's x-independent scalar w[n, k]. Each weight scalar
// feeds 2W products and each panel vector NR, so the FMA pipes, not the loads, bound the loop.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel.h"

namespace minimlx_native {

template <class Simd>
constexpr int kPanelRows = 2 * Simd::W;

// Input rows per pass over a block of weight rows: their panels stay in L2 (256 KB) while each tile of weight
// rows sweeps them; a tile's weights (NR x K floats) stay in L1 meanwhile.
constexpr int64_t kPanelPassBytes = 256 * 1024;

// Panels [panel_begin, panel_end) of x (M rows of K), the last padded with zero rows.
template <class Simd>
void pack_panels(const float* x, int M, int K, float* panels, int panel_begin, int panel_end) {
  constexpr int P = kPanelRows<Simd>;
  for (int p = panel_begin; p < panel_end; ++p) {
    float* panel = panels + static_cast<int64_t>(p) * K * P;
    const int rows = std::min(P, M - p * P);
    for (int k0 = 0; k0 < K; k0 += 16) {  // 16 floats of each row at a time: one cache line read per row
      const int k1 = std::min(K, k0 + 16);
      for (int i = 0; i < rows; ++i) {
        const float* row = x + static_cast<int64_t>(p * P + i) * K;
        for (int k = k0; k < k1; ++k) panel[k * P + i] = row[k];
      }
      for (int i = rows; i < P; ++i)
        for (int k = k0; k < k1; ++k) panel[k * P + i] = 0.0f;
    }
  }
}

// Outputs [m0, m0 + rows) x [n, n + NR) from one panel and NR weight rows.
template <class Simd, int NR>
__attribute__((noinline)) void gemm_tile(const float* panel, const float* w, int K, float* out, int N, int n, int m0,
                                         int rows) {
  using V = typename Simd::V;
  constexpr int W = Simd::W, P = kPanelRows<Simd>;
  V acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = Simd::zero();
  const float* weights = w + static_cast<int64_t>(n) * K;
  for (int k = 0; k < K; ++k) {
    const V x0 = Simd::load(panel + k * P), x1 = Simd::load(panel + k * P + W);
    for (int r = 0; r < NR; ++r) {
      const V weight = Simd::set1(weights[static_cast<int64_t>(r) * K + k]);
      acc[r][0] = Simd::fma(weight, x0, acc[r][0]);
      acc[r][1] = Simd::fma(weight, x1, acc[r][1]);
    }
  }
  alignas(64) float tile[NR][P];
  for (int r = 0; r < NR; ++r) {
    Simd::store(tile[r], acc[r][0]);
    Simd::store(tile[r] + W, acc[r][1]);
  }
  for (int i = 0; i < rows; ++i)
    for (int r = 0; r < NR; ++r) out[static_cast<int64_t>(m0 + i) * N + n + r] = tile[r][i];
}

// Weight rows from `n` on, NR at a time while NR of them remain before `row_end`, against panels [first, last);
// returns the first row not done.
template <class Simd, int NR>
int gemm_tiles(const Gemm& g, int n, int row_end, int first, int last) {
  constexpr int P = kPanelRows<Simd>;
  for (; n + NR <= row_end; n += NR)
    for (int p = first; p < last; ++p)
      gemm_tile<Simd, NR>(g.panels + static_cast<int64_t>(p) * g.K * P, g.w, g.K, g.out, g.N, n, p * P,
                          std::min(P, g.M - p * P));
  return n;
}

// Output columns [row_begin, row_end) (weight rows) for all M input rows, from the packed panels: tiles of NR
// weight rows (NR x 2 sums, 2 inputs and 1 weight in registers), then of 4 and 1 for the rest.
template <class Simd>
void gemm_rows(const Gemm& g, int row_begin, int row_end) {
  constexpr int P = kPanelRows<Simd>, NR = Simd::registers == 32 ? 12 : 6;
  const int panel_count = (g.M + P - 1) / P;
  const int per_pass = static_cast<int>(std::max<int64_t>(1, kPanelPassBytes / (static_cast<int64_t>(g.K) * P * 4)));
  for (int first = 0; first < panel_count; first += per_pass) {
    const int last = std::min(panel_count, first + per_pass);
    int n = gemm_tiles<Simd, NR>(g, row_begin, row_end, first, last);
    n = gemm_tiles<Simd, 4>(g, n, row_end, first, last);
    gemm_tiles<Simd, 1>(g, n, row_end, first, last);
  }
}

}  // namespace minimlx_native
