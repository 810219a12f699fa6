// The products of a prompt's many input rows with weights held as GGUF blocks, in integers (AVX-512 VNNI).
//
// Every block type is one form here: a weight row is groups of `span` values, value k of group g being
// scale_g code_k - bias_g with an unsigned 8-bit code (Q4_K, Q5_K: d sc_j q - dmin m_j over sub-blocks of 32; Q6_K:
// d sc_g q - 32 d sc_g over groups of 16, q = 0..63; Q8_0: d (q + 128) - 128 d over blocks of 32, its codes' sign bit
// flipped). With inputs quantized per block of 32 (x ~ xd xq), a product is
//
//   sum_g scale_g xd_g sum_(k in g) code_k xq_k  -  sum_g bias_g xd_g sum_(k in g) xq_k,
//
// whose inner sums are exact in 32-bit integers. A tile of 32 weight rows is unpacked once into a panel: for each
// 4 values of the row, the 32 rows' 4 codes side by side (two vectors of 16 rows), and each group's scales and biases
// as 32 floats. Four input rows at a time then sweep the panel: each step broadcasts 4 codes of an input row and adds
// its products with 16 weight rows into 16 lanes at once (vpdpbusd), so a vector of codes serves four input rows and
// an input's broadcast two vectors; at each group's end the 32-bit sums are scaled into float32 sums.
#pragma once

#include <immintrin.h>

#include <vector>

#include "kquant_avx512.h"

namespace minimlx_native {

// A tile of weight rows unpacked: codes (K / 4 steps of 32 rows x 4 bytes), scales and biases (groups x 32 rows).
struct GemmPanel {
  std::vector<uint8_t, CacheAligned<uint8_t>> codes;
  std::vector<float, CacheAligned<float>> scales, biases;
  int K = 0, groups = 0, span = 0;

  void reset(int type, int k) {
    K = k, span = group_span(type), groups = k / span;
    codes.assign(static_cast<size_t>(K) * kGemmTileRows, 0);
    scales.assign(static_cast<size_t>(groups) * kGemmTileRows, 0.0f);
    biases.assign(static_cast<size_t>(groups) * kGemmTileRows, 0.0f);
  }

  // Row r of the tile from one weight row of `type`: its codes (unsigned, in the order of its values) and its groups'
  // scales and biases.
  void unpack(int type, const uint8_t* w, int r) {
    alignas(64) uint8_t row[256];
    float* scale = scales.data() + r;
    float* bias = biases.data() + r;
    const int bytes = block_bytes(type);
    const int values = block_values(type);
    for (int b = 0; b < K / values; ++b, w += bytes) {
      switch (static_cast<Blocks>(type)) {
        case Blocks::q8_0: {
          const float d = half_at(w);
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
          _mm256_store_si256(reinterpret_cast<__m256i*>(row), _mm256_xor_si256(q, _mm256_set1_epi8(-128)));
          scale[b * kGemmTileRows] = d;
          bias[b * kGemmTileRows] = 128.0f * d;
          break;
        }
        case Blocks::q6_k: {
          __m512i codes4[4];
          Avx512BlockDot::q6_k_codes(w, codes4);
          for (int c = 0; c < 4; ++c) _mm512_store_si512(row + 64 * c, codes4[c]);
          const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
          const float d = half_at(w + 208);
          for (int g = 0; g < 16; ++g) {
            scale[(16 * b + g) * kGemmTileRows] = d * static_cast<float>(sc[g]);
            bias[(16 * b + g) * kGemmTileRows] = 32.0f * d * static_cast<float>(sc[g]);
          }
          break;
        }
        default: {
          __m512i codes4[4];
          if (type == static_cast<int>(Blocks::q5_k)) Avx512BlockDot::k_quant_codes<true>(w, codes4);
          else Avx512BlockDot::k_quant_codes<false>(w, codes4);
          for (int c = 0; c < 4; ++c) _mm512_store_si512(row + 64 * c, codes4[c]);
          uint8_t sc[8], mn[8];
          scales_and_mins(w + 4, sc, mn);
          const float d = half_at(w), dmin = half_at(w + 2);
          for (int g = 0; g < 8; ++g) {
            scale[(8 * b + g) * kGemmTileRows] = d * static_cast<float>(sc[g]);
            bias[(8 * b + g) * kGemmTileRows] = dmin * static_cast<float>(mn[g]);
          }
        }
      }
      uint32_t* steps = reinterpret_cast<uint32_t*>(codes.data()) + static_cast<int64_t>(b) * (values / 4) * kGemmTileRows + r;
      const uint32_t* four = reinterpret_cast<const uint32_t*>(row);
      for (int s = 0; s < values / 4; ++s) steps[s * kGemmTileRows] = four[s];
    }
  }
};

// Outputs [m0, m0 + MR) x [n0, n0 + 32) (the first `valid` columns stored) from a panel.
template <int MR>
inline void gemm_panel_rows(const GemmPanel& panel, const GemmInputs& x, int m0, float* out, int64_t N, int n0,
                            int valid) {
  const int K = panel.K, groups = panel.groups, span = panel.span;
  __m512 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm512_setzero_ps();
  const int8_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = x.xq + static_cast<int64_t>(m0 + m) * K;
  const uint8_t* codes = panel.codes.data();
  for (int g = 0; g < groups; ++g) {
    __m512i sums[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MR; ++m) sums[h][m] = _mm512_setzero_si512();
    const uint8_t* c = codes + static_cast<int64_t>(g) * span * kGemmTileRows;
    const int first = g * span;
    for (int s = 0; s < span / 4; ++s) {
      const __m512i w0 = _mm512_load_si512(c + 128 * s), w1 = _mm512_load_si512(c + 128 * s + 64);
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, xq[m] + first + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        sums[0][m] = _mm512_dpbusd_epi32(sums[0][m], w0, xb);
        sums[1][m] = _mm512_dpbusd_epi32(sums[1][m], w1, xb);
      }
    }
    const float* scale = panel.scales.data() + static_cast<int64_t>(g) * kGemmTileRows;
    const float* bias = panel.biases.data() + static_cast<int64_t>(g) * kGemmTileRows;
    for (int h = 0; h < 2; ++h) {
      const __m512 sc = _mm512_load_ps(scale + 16 * h), bi = _mm512_load_ps(bias + 16 * h);
      for (int m = 0; m < MR; ++m) {
        const int64_t at = static_cast<int64_t>(m0 + m) * groups + g;
        const __m512 step = _mm512_set1_ps(x.steps[at]);
        acc[h][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[h][m]), _mm512_mul_ps(sc, step), acc[h][m]);
        acc[h][m] = _mm512_fnmadd_ps(bi, _mm512_set1_ps(x.step_sums[at]), acc[h][m]);
      }
    }
  }
  const __mmask16 low = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 high = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  for (int m = 0; m < MR; ++m) {
    float* row = out + static_cast<int64_t>(m0 + m) * N + n0;
    _mm512_mask_storeu_ps(row, low, acc[0][m]);
    _mm512_mask_storeu_ps(row + 16, high, acc[1][m]);
  }
}

// Output columns [row_begin, row_end) (weight rows, whole tiles of 32 but the last) for every input row of `p`, whose
// inputs `x` (prepared for p's type) are shared.
inline void gemm_block_rows(const BlockProblem& p, const GemmInputs& x, int row_begin, int row_end) {
  thread_local GemmPanel panel;
  for (int n0 = row_begin; n0 < row_end; n0 += kGemmTileRows) {
    const int valid = std::min(kGemmTileRows, row_end - n0);
    panel.reset(p.type, p.K);
    for (int r = 0; r < valid; ++r) panel.unpack(p.type, p.w + static_cast<int64_t>(n0 + r) * p.row_bytes, r);
    int m = 0;
    for (; m + 4 <= p.M; m += 4) gemm_panel_rows<4>(panel, x, m, p.out, p.N, n0, valid);
    for (; m < p.M; ++m) gemm_panel_rows<1>(panel, x, m, p.out, p.N, n0, valid);
  }
}

}  // namespace minimlx_native
