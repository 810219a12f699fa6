// Products with GGUF's block-quantized weights read as the file stores them: Q4_K, Q5_K, Q6_K (super-blocks of 256
// values) and Q8_0 (blocks of 32), each weight row its blocks one after another, as ggml lays them out:
//
//   Q4_K (144 bytes): d, dmin (float16), 12 bytes of eight 6-bit scales sc and mins m, 128 bytes of 4-bit codes q;
//                     value i of sub-block j (32 values) is d sc_j q - dmin m_j. Byte l of the codes' chunk c (32
//                     bytes) holds value l of sub-block 2c in its low nibble, of sub-block 2c + 1 in its high one.
//   Q5_K (176 bytes): Q4_K's with a fifth bit per code (32 bytes, qh, before the codes): bit j of qh[l] is the high
//                     bit of value l of sub-block j.
//   Q6_K (210 bytes): 128 bytes of the codes' low 4 bits (ql), 64 of their high 2 (qh), sixteen int8 scales, d;
//                     value i is d sc_(i / 16) (q_i - 32). For each half of 128 values (ql + 64 h, qh + 32 h), value
//                     l + 32 s (l < 32, s = 0..3) has its low bits in nibble s / 2 of ql[l + 32 (s % 2)] and its high
//                     bits at bit 2 s of qh[l].
//   Q8_0 (34 bytes):  d (float16), 32 int8 codes; value i is d q_i.
//
// The inputs are quantized per block of 32 values as llama.cpp's Q8_0 activations are: x ~ xd * xq, xd = max |x| /
// 127, xq = round(x / xd), with the sums of each 16 codes (the mins' and offsets' terms). (llama.cpp multiplies the
// K-quants by Q8_K inputs, one xd per 256 values, whose rounding an outlier sets for 256 values rather than 32: a
// product's error, at most sum_k |w_k| xd_k / 2, is several times larger on the heavy-tailed inputs of a down
// projection.) A product's inner sums are then sums of byte products in 32-bit integers, one per sub-block of 32,
// scaled once: for Q4_K, out = sum_blocks d sum_j sc_j xd_j sum_i q xq - dmin sum_j m_j xd_j sum_i xq.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace minimlx_native {

// ggml's numbers for the types (the GGUF tensor types).
enum class Blocks : int { q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14 };

// Values per block and bytes per block of a type; 0 for a number that is none of them.
inline int block_values(int type) { return type == static_cast<int>(Blocks::q8_0) ? 32 : 256; }
inline int block_bytes(int type) {
  switch (static_cast<Blocks>(type)) {
    case Blocks::q8_0: return 34;
    case Blocks::q4_k: return 144;
    case Blocks::q5_k: return 176;
    case Blocks::q6_k: return 210;
    default: return 0;
  }
}

// The inputs of a product with block-quantized weights: M rows of K values as `quantize_blocks` writes them.
struct QuantizedBlockInputs {
  const int8_t* xq;      // M rows of K codes
  const float* xd;       // M rows of K / 32 block scales
  const int16_t* sums;   // M rows of K / 16 sums of 16 codes
  // Where K is a multiple of 256 (`QuantizedBlocks` makes them): per row, super_block_steps (K / 16 floats) and the
  // codes in the order the AVX-512 K-quant products read them (interleave_by_16, K codes).
  const float* steps = nullptr;
  const int8_t* interleaved = nullptr;

  // The inputs from row m on (of K values each).
  QuantizedBlockInputs from_row(int m, int K) const {
    const int64_t at = static_cast<int64_t>(m) * K;
    return {xq + at, xd + at / 32, sums + at / 16, steps ? steps + at / 16 : nullptr,
            interleaved ? interleaved + at : nullptr};
  }
};

// out (M x N) = x @ w.T for weights w (N rows of K / span blocks of `type`) and quantized inputs x.
struct BlockProblem {
  const uint8_t* w;
  int64_t row_bytes;
  int type;
  QuantizedBlockInputs x;
  float* out;
  int M, N, K;
  const float* xf = nullptr;  // x in float32 (M x K), for `float_block_rows`
};

// A row of x (K values, a multiple of 32) quantized per block of 32 values into xq, xd and the 16-code sums.
inline void quantize_blocks(const float* x, int K, int8_t* xq, float* xd, int16_t* sums) {
  constexpr int span = 32;
  for (int b = 0; b < K / span; ++b) {
    const float* v = x + static_cast<int64_t>(b) * span;
    float amax = 0.0f;
    for (int i = 0; i < span; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    xd[b] = d;
    int8_t* q = xq + static_cast<int64_t>(b) * span;
    // |v inverse| <= 127: adding and taking away 1.5 * 2^23 rounds it to the nearest integer, ties to even (as
    // nearbyint does in the default rounding mode), in a loop the compiler vectorizes rather than a libm call each
    for (int i = 0; i < span; ++i) q[i] = static_cast<int8_t>((v[i] * inverse + 12582912.0f) - 12582912.0f);
  }
  for (int g = 0; g < K / 16; ++g) {
    int total = 0;
    for (int i = 0; i < 16; ++i) total += xq[16 * g + i];
    sums[g] = static_cast<int16_t>(total);
  }
}

// A row's steps per super-block of 256 values (K a multiple of 256) from its blocks' xd and 16-code sums: the eight
// blocks' xd, then each xd times the sum of its 32 codes (the mins' and offsets' factors), 16 floats a super-block.
inline void super_block_steps(const float* xd, const int16_t* sums, int K, float* steps) {
  for (int s = 0; s < K / 256; ++s, xd += 8, sums += 16, steps += 16)
    for (int j = 0; j < 8; ++j) {
      steps[j] = xd[j];
      steps[8 + j] = xd[j] * static_cast<float>(sums[2 * j] + sums[2 * j + 1]);
    }
}

// A row's codes (K a multiple of 256) with each super-block's sixteen pieces of 16 codes transposed as a 4 x 4
// matrix: piece 4v + k of the result is piece 4k + v of the row. Vector v (64 bytes) then holds, in its 128-bit lane k,
// values 16v' .. 16v' + 15 of sub-block 2k + v / 2 (v' = v % 2): the values a Q4_K or Q5_K block's codes meet when its
// four 32-byte chunks' v'-th halves are loaded as one vector (low nibbles for v < 2, high ones for v >= 2).
inline void interleave_by_16(const int8_t* xq, int K, int8_t* out) {
  for (int s = 0; s < K / 256; ++s, xq += 256, out += 256)
    for (int v = 0; v < 4; ++v)
      for (int k = 0; k < 4; ++k) std::memcpy(out + 64 * v + 16 * k, xq + 64 * k + 16 * v, 16);
}

// Q4_K's and Q5_K's eight 6-bit scales and eight 6-bit mins from their 12 bytes: sc_j, m_j are the low 6 bits of
// bytes j and j + 4 for j < 4; for j >= 4 their low 4 bits are the nibbles of byte j + 4, their high 2 bits the top
// bits of bytes j - 4 and j.
inline void scales_and_mins(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  const uint32_t sc[2] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & low2) << 4)};
  const uint32_t mn[2] = {w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4)};
  std::memcpy(scales, sc, 8);
  std::memcpy(mins, mn, 8);
}

inline float half_at(const uint8_t* p) {
  Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

// One row of K values of `type` dequantized to float32 (the weights' exact values, as gguf.quants gives them).
inline void dequantize_blocks(int type, const uint8_t* row, int K, float* out) {
  const int bytes = block_bytes(type), span = block_values(type);
  for (int b = 0; b < K / span; ++b, row += bytes, out += span) {
    switch (static_cast<Blocks>(type)) {
      case Blocks::q8_0: {
        const float d = half_at(row);
        for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(row[2 + i]));
        break;
      }
      case Blocks::q4_k:
      case Blocks::q5_k: {
        const bool five = type == static_cast<int>(Blocks::q5_k);
        const float d = half_at(row), dmin = half_at(row + 2);
        uint8_t sc[8], mn[8];
        scales_and_mins(row + 4, sc, mn);
        const uint8_t *qh = row + 16, *qs = row + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          const float scale = d * sc[j], min = dmin * mn[j];
          for (int l = 0; l < 32; ++l) {
            int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
            if (five) q |= ((qh[l] >> j) & 1) << 4;
            out[32 * j + l] = scale * static_cast<float>(q) - min;
          }
        }
        break;
      }
      case Blocks::q6_k: {
        const uint8_t *ql = row, *qh = row + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
        const float d = half_at(row + 208);
        for (int h = 0; h < 2; ++h)
          for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) {
              const int low = ql[64 * h + l + 32 * (s % 2)] >> (4 * (s / 2)) & 15;
              const int q = (low | ((qh[32 * h + l] >> (2 * s)) & 3) << 4) - 32;
              const int i = 128 * h + 32 * s + l;
              out[i] = d * static_cast<float>(sc[i / 16]) * static_cast<float>(q);
            }
        break;
      }
    }
  }
}

// Weight rows [row_begin, row_end) of a product dequantized to float32 into dst (K floats a row).
inline void dequantize_block_rows(const BlockProblem& p, int row_begin, int row_end, float* dst) {
  for (int n = row_begin; n < row_end; ++n)
    dequantize_blocks(p.type, p.w + n * p.row_bytes, p.K, dst + static_cast<int64_t>(n - row_begin) * p.K);
}

// Output rows [row_begin, row_end) for every input row from float32 inputs `p.xf` (the exact products of a few rows:
// a tied head's, `--exact`): each weight row dequantized once into L1, then dotted with each input row in 16 float32
// partial sums (vectors of the file's instruction set), added in a fixed order.
inline void float_block_rows(const BlockProblem& p, int row_begin, int row_end) {
  thread_local std::vector<float> row;
  row.resize(p.K);
  for (int n = row_begin; n < row_end; ++n) {
    dequantize_blocks(p.type, p.w + n * p.row_bytes, p.K, row.data());
    for (int m = 0; m < p.M; ++m) {
      const float* x = p.xf + static_cast<int64_t>(m) * p.K;
      float partial[16] = {};
      for (int k = 0; k < p.K; k += 16)
        for (int i = 0; i < 16; ++i) partial[i] += x[k + i] * row[k + i];
      float total = 0.0f;
      for (int i = 0; i < 16; ++i) total += partial[i];
      p.out[static_cast<int64_t>(m) * p.N + n] = total;
    }
  }
}

// MB input rows of a product: each one's codes, block steps and 16-code sums.
template <int MB>
struct InputRows {
  const int8_t* xq[MB];
  const float* xd[MB];
  const int16_t* sums[MB];
  const float* steps[MB];          // super_block_steps, where the inputs have them
  const int8_t* interleaved[MB];   // interleave_by_16's codes, where the inputs have them
};

// Weight rows per tile of the products: the rows a tile of input rows meets while it stays in L1.
constexpr int kWeightRowsPerTile = 16;

// The weight bytes ahead of the block being read that a row product asks for (about what one core has in flight from
// memory): each block's products ask for the block that far on, so weights far beyond the caches stream in while the
// blocks before them are computed, a few lines at a time. A whole row asked for at once (thousands of bytes) filled
// the core's miss buffers and stalled the products behind the requests.
constexpr int kPrefetchAhead = 2560;

inline void prefetch_ahead(const uint8_t* block, int bytes) {
  for (int at = 0; at < bytes; at += 64) __builtin_prefetch(block + kPrefetchAhead + at);
}

// Output row n for input rows [m0, m0 + MB), by `Dot`, which gives a weight row's dot products with MB quantized input
// rows for each type (k_quant<FIVE, MB> for Q4_K and Q5_K, q6_k<MB>, q8_0<MB>), each row's sums in the same order
// whatever MB is.
template <class Dot, int MB>
inline void block_tile(const BlockProblem& p, int n, int m0) {
  const int blocks = p.K / block_values(p.type);
  const uint8_t* w = p.w + n * p.row_bytes;
  InputRows<MB> x;
  for (int m = 0; m < MB; ++m) {
    const QuantizedBlockInputs row = p.x.from_row(m0 + m, p.K);
    x.xq[m] = row.xq;
    x.xd[m] = row.xd;
    x.sums[m] = row.sums;
    x.steps[m] = row.steps;
    x.interleaved[m] = row.interleaved;
  }
  float out[MB];
  switch (static_cast<Blocks>(p.type)) {
    case Blocks::q4_k: Dot::template k_quant<false, MB>(w, x, blocks, out); break;
    case Blocks::q5_k: Dot::template k_quant<true, MB>(w, x, blocks, out); break;
    case Blocks::q6_k: Dot::template q6_k<MB>(w, x, blocks, out); break;
    default: Dot::template q8_0<MB>(w, x, blocks, out); break;
  }
  for (int m = 0; m < MB; ++m) p.out[static_cast<int64_t>(m0 + m) * p.N + n] = out[m];
}

// The products of output rows [row_begin, row_end) for every input row: tiles of kWeightRowsPerTile weight rows, each
// met by the input rows four at a time (their codes unpacked once for the four) and then one at a time. Each (input
// row, output row) pair is summed in the same order whatever the rows beside it, so a batch's row gets what it gets
// alone.
template <class Dot>
void integer_block_rows(const BlockProblem& p, int row_begin, int row_end) {
  for (int n0 = row_begin; n0 < row_end; n0 += kWeightRowsPerTile) {
    const int n1 = std::min(row_end, n0 + kWeightRowsPerTile);
    int m = 0;
    for (; m + 4 <= p.M; m += 4)
      for (int n = n0; n < n1; ++n) block_tile<Dot, 4>(p, n, m);
    for (; m < p.M; ++m)
      for (int n = n0; n < n1; ++n) block_tile<Dot, 1>(p, n, m);
  }
}

// The block products in plain C++: the reference the SIMD ones are tested against, one input row at a time.
struct ScalarBlockDot {
  template <bool FIVE, int MB>
  static void k_quant(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    for (int m = 0; m < MB; ++m) out[m] = k_quant_row<FIVE>(w, x.xq[m], x.xd[m], x.sums[m], blocks);
  }
  template <int MB>
  static void q6_k(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    for (int m = 0; m < MB; ++m) out[m] = q6_k_row(w, x.xq[m], x.xd[m], x.sums[m], blocks);
  }
  template <int MB>
  static void q8_0(const uint8_t* w, const InputRows<MB>& x, int blocks, float* out) {
    for (int m = 0; m < MB; ++m) out[m] = q8_0_row(w, x.xq[m], x.xd[m], blocks);
  }
  template <bool FIVE>
  static float k_quant_row(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* sums, int blocks) {
    float total = 0.0f;
    for (int b = 0; b < blocks; ++b, w += FIVE ? 176 : 144, xq += 256, xd += 8, sums += 16) {
      uint8_t sc[8], mn[8];
      scales_and_mins(w + 4, sc, mn);
      const uint8_t *qh = w + 16, *qs = w + (FIVE ? 48 : 16);
      float dots = 0.0f, mins = 0.0f;
      for (int j = 0; j < 8; ++j) {
        int32_t s = 0;
        for (int l = 0; l < 32; ++l) {
          int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
          if constexpr (FIVE) q |= ((qh[l] >> j) & 1) << 4;
          s += q * xq[32 * j + l];
        }
        dots += static_cast<float>(sc[j] * s) * xd[j];
        mins += static_cast<float>(mn[j] * (sums[2 * j] + sums[2 * j + 1])) * xd[j];
      }
      total += half_at(w) * dots - half_at(w + 2) * mins;
    }
    return total;
  }
  static float q6_k_row(const uint8_t* w, const int8_t* xq, const float* xd, const int16_t* sums, int blocks) {
    float total = 0.0f;
    for (int b = 0; b < blocks; ++b, w += 210, xq += 256, xd += 8, sums += 16) {
      const uint8_t *ql = w, *qh = w + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      float dots = 0.0f;
      for (int j = 0; j < 8; ++j) {
        int32_t dot = 0;
        for (int g = 2 * j; g < 2 * j + 2; ++g) {
          int32_t s = 0;
          for (int i = 16 * g; i < 16 * g + 16; ++i) {
            const int h = i / 128, r = i % 128, sp = r / 32, l = r % 32;
            const int low = ql[64 * h + l + 32 * (sp % 2)] >> (4 * (sp / 2)) & 15;
            s += (low | ((qh[32 * h + l] >> (2 * sp)) & 3) << 4) * xq[i];
          }
          dot += sc[g] * (s - 32 * sums[g]);
        }
        dots += static_cast<float>(dot) * xd[j];
      }
      total += half_at(w + 208) * dots;
    }
    return total;
  }
  static float q8_0_row(const uint8_t* w, const int8_t* xq, const float* xd, int blocks) {
    float total = 0.0f;
    for (int b = 0; b < blocks; ++b, w += 34, xq += 32) {
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) s += static_cast<int8_t>(w[2 + i]) * xq[i];
      total += xd[b] * half_at(w) * static_cast<float>(s);
    }
    return total;
  }
};

// The integer GEMM's view of a block type (kquant_gemm_avx512.h): its values in groups of one scale and bias each,
// sub-blocks of 32 (Q4_K, Q5_K), groups of 16 (Q6_K) or blocks of 32 (Q8_0).
constexpr int kGemmTileRows = 32;  // weight rows an integer GEMM's panel holds: two vectors of 16 lanes

inline int group_span(int type) { return type == static_cast<int>(Blocks::q6_k) ? 16 : 32; }

// The input rows' side of an integer GEMM: per row and group of `span` values, its block's step xd and xd times the
// sum of the group's codes (`GemmInputStore` makes them).
struct GemmInputs {
  const int8_t* xq = nullptr;
  const float* steps = nullptr;      // M x (K / span)
  const float* step_sums = nullptr;  // M x (K / span)
  int span = 0;

  // The same inputs from row m on (of K values each).
  GemmInputs from_row(int m, int K) const {
    const int64_t groups = K / span;
    return {xq + static_cast<int64_t>(m) * K, steps + m * groups, step_sums + m * groups, span};
  }
};

struct GemmInputStore {
  std::vector<float> steps, step_sums;

  GemmInputs prepare(const QuantizedBlockInputs& x, int M, int K, int span) {
    const int groups = K / span;
    steps.resize(static_cast<size_t>(M) * groups);
    step_sums.resize(steps.size());
    for (int m = 0; m < M; ++m) {
      const float* xd = x.xd + static_cast<int64_t>(m) * (K / 32);
      const int16_t* sums = x.sums + static_cast<int64_t>(m) * (K / 16);
      float* step = steps.data() + static_cast<int64_t>(m) * groups;
      float* step_sum = step_sums.data() + static_cast<int64_t>(m) * groups;
      for (int g = 0; g < groups; ++g) {
        const int first = g * span / 16;  // the group's first 16-code sum
        const int total = span == 16 ? sums[first] : sums[first] + sums[first + 1];
        step[g] = xd[g * span / 32];
        step_sum[g] = step[g] * static_cast<float>(total);
      }
    }
    return {x.xq, steps.data(), step_sums.data(), span};
  }
};

// Each instruction set's block products and dequantization.
void block_rows_scalar(const BlockProblem& p, int row_begin, int row_end);
void float_block_rows_scalar(const BlockProblem& p, int row_begin, int row_end);
void dequantize_blocks_scalar(const BlockProblem& p, int row_begin, int row_end, float* dst);
#if defined(__x86_64__) || defined(_M_X64)
void block_rows_avx2(const BlockProblem& p, int row_begin, int row_end);
void float_block_rows_avx2(const BlockProblem& p, int row_begin, int row_end);
void dequantize_blocks_avx2(const BlockProblem& p, int row_begin, int row_end, float* dst);
void block_rows_avx512vnni(const BlockProblem& p, int row_begin, int row_end);
void float_block_rows_avx512vnni(const BlockProblem& p, int row_begin, int row_end);
void dequantize_blocks_avx512vnni(const BlockProblem& p, int row_begin, int row_end, float* dst);
void block_gemm_avx512vnni(const BlockProblem& p, const GemmInputs& x, int row_begin, int row_end);
#endif

}  // namespace minimlx_native
