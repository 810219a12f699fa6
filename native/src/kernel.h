// Matrix-vector products with MLX affine-quantized weights, read packed.
//
// The weight is N rows of K values, each row packed into uint32 words (bits 4 or 8, first value in
// the lowest bits), with one scale and bias (float32, or float16 read as float32) per group of `group_size`
// consecutive values:
// w[n, k] = scales[n, g] * q[n, k] + biases[n, g], g = k / group_size. For M input rows x,
//
//   out[m, n] = sum_g scales[n, g] * sum_{k in g} q[n, k] x[m, k] + sum_g biases[n, g] * xsum[m, g]
//
// where xsum[m, g] is the sum of x[m] over group g: the inner sums touch only packed integers and
// x, and the weights are streamed once per call whatever M is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

namespace minimlx_native {

// Scratch floats on 64-byte boundaries, so that the kernels' vector loads of a row never straddle two cache
// lines (a load that does touches both).
template <class T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheAligned() = default;
  template <class U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  bool operator==(const CacheAligned&) const { return true; }
};

// IEEE float16, as MLX's float16 arrays hold it (GCC on aarch64 spells it __fp16 in C++).
#if defined(__aarch64__) && !defined(__clang__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

// out[i] = x[i] as float16, rounded to nearest (even on ties), for i in [0, n): one instruction each where the file's
// instruction set has F16C, a library call in plain x86-64. Inlined into each file's own function, so that each keeps
// its own instructions.
[[gnu::always_inline]] inline void halves_range(const float* x, Half* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Half>(x[i]);
}

struct Problem {
  const float* x;        // M x K, laid out as `prepare_inputs` writes it
  const float* xsum;     // M x (K / group_size), rows integer_rows_from(M) on
  const uint8_t* w;      // N rows of K * bits / 8 bytes
  const void* scales;    // N x (K / group_size), float32, or Half where `half_scales`
  const void* biases;    // N x (K / group_size), of the scales' type
  float* out;            // M x N
  int M, N, K, group_size, bits;
  bool half_scales;
  // The integer products' inputs (integer.h), as `quantize_inputs` writes them; xsum then holds their group sums.
  const int8_t* xq;      // M rows of xq_stride
  const float* xd;       // M rows of xq_stride / span * lanes
  const int8_t* xq2;     // the second parts, laid out as xq (zeros in a block without one)
  const float* xd2;      // their scales, laid out as xd (zeros likewise)
  const uint8_t* parts;  // M rows of xq_stride / span: whether a step has any second part
  int xq_stride;
};

// Where `quantize_inputs` writes: the codes and block scales of each input row, a second part's for the blocks that get
// one (integer.h), each step's flag, and the group sums of what the two parts stand for.
struct QuantizedInputs {
  int8_t* xq;
  float* xd;
  int8_t* xq2;
  float* xd2;
  uint8_t* parts;
  float* xsum;
};

// softmax(q k^T * scale) v with a causal mask, for float32 q (batch, heads, queries, head_dim) and float32 or float16
// k, v (batch, kv_heads, keys, head_dim) given by strides in elements (the last axis contiguous); queries are the
// last `queries` of the `keys` positions. Where `mask` is given, a query also sees only the keys it marks:
// mask[b * mask_strides[0] + i * mask_strides[1] + j * mask_strides[2]] for query i and key j of row b (a
// stride of 0 repeats a row). The output, contiguous (batch, heads, queries, head_dim), is `KeySegment`'s.
struct Attention {
  const float* q;
  const void* k;  // float32, or Half where `half_kv`
  const void* v;
  int64_t q_strides[3], k_strides[3], v_strides[3];  // batch, head, position, in elements
  int batch, heads, kv_heads, queries, keys, head_dim;
  float scale;
  const bool* mask;
  int64_t mask_strides[3];  // batch, query, key
  bool half_kv = false;  // keys and values held in float16, widened as they are read
};

// Keys or values held quantized as `mx.quantize` holds a weight (minimlx's QuantizedKVCache): each row of head_dim
// features is `bits`-bit codes (4 or 8, packed as kernel.h's weights) and a float32 scale and bias per group of
// `group_size` features, value = scale * code + bias. Strides (batch, head, position) in bytes for the codes and
// in floats for the scales and biases (whose groups are contiguous).
struct QuantizedRows {
  const uint8_t* codes;
  const float* scales;
  const float* biases;
  int64_t code_strides[3], group_strides[3];
};

// softmax(q k^T * scale) v as `Attention`, over quantized k and v.
struct QuantizedAttention {
  const float* q;
  int64_t q_strides[3];
  QuantizedRows k, v;
  int batch, heads, kv_heads, queries, keys, head_dim, group_size, bits;
  float scale;
  const bool* mask;
  int64_t mask_strides[3];
};

// Which keys one work item of attention reads, and where its results go: of the keys a query sees, in order, those
// numbered [begin, end). With `tops` null they are every key, and `out` (batch, heads, queries, head_dim) gets the
// attention's output. Else they are one segment of them (flash decoding: a decode step's few queries are split over
// their keys, so that every thread has work), and out gets the segment's weighted sum of values unnormalised, `tops`
// its top score and `totals` its sum of e^(score - top), 0 where the query sees none of its keys (both laid out as
// out without head_dim); the segments are combined afterwards. Numbered among the keys a query sees, a segment holds
// the same keys whatever else the array holds (a batch's longer rows, their left padding, a fixed cache's capacity).
struct KeySegment {
  int begin, end;
  float* out;
  float* tops;
  float* totals;
};

// out (M x N) = x @ w.T for float32 x (M x K) and w (N x K), x packed into panels of `panel_rows` inputs
// (gemm.h).
struct Gemm {
  const float* panels;
  const float* w;
  float* out;
  int M, N, K;
};

// The first input row that the integer-sum loop takes (the ones before go in blocks of 8 and 4, which
// dequantize the weights instead and need no group sums of x).
inline int integer_rows_from(int M) { return M % 8 >= 4 ? M - M % 8 + 4 : M - M % 8; }

// 4-bit values are unpacked as the low nibbles of 16 bytes (values 0, 2, ..., 30 of a chunk of 32)
// followed by their high nibbles (values 1, 3, ..., 31), so each chunk of 32 inputs is stored in
// that order; 8-bit values are in order. xsum_out gets the group sums of rows integer_rows_from(M) on.
void prepare_inputs(const float* x, int M, int K, int group_size, int bits, float* x_out, float* xsum_out);

// Input rows quantized per block of 32 values for the integer products (integer.h), as llama.cpp's
// quantize_row_q8_1 does: d = max |x| / 127, xq = round(x / d), and, for a block whose largest value is more than
// kSecondPart times the row's median block's, a second part quantized the same way from what the first leaves,
// x - d xq. Each row is `stride` bytes of xq (K rounded up to `span`, zeros past K), each step of `span` values in
// order, or with `nibbles` in the order of 4-bit codes (its values 0, 2, 4, ..., then 1, 3, 5, ...); xd gets each
// block's d in the `lanes * 32 / span` lanes of its sums in a step (xq2 and xd2 likewise the second parts, zeros
// where a block has none), `parts` whether each step has any, xsum the sum over each group's blocks of what the parts
// stand for, d * sum(xq) + d2 * sum(xq2).
int quantized_stride(int K, int span);
void quantize_inputs(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                     const QuantizedInputs& out);
#if defined(__x86_64__) || defined(_M_X64)
void quantize_inputs_avx2(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                          const QuantizedInputs& out);
void quantize_inputs_avx512vnni(const float* x, int M, int K, int group_size, int span, int lanes, bool nibbles,
                                const QuantizedInputs& out);
#endif

// Rows [row_begin, row_end) of out, for every input row, from the quantized inputs. One function per integer
// instruction set, with its step of `span` values and the W lanes of its float vectors.
void integer_rows_scalar(const Problem& p, int row_begin, int row_end);
#if defined(__x86_64__) || defined(_M_X64)
void integer_rows_avx2(const Problem& p, int row_begin, int row_end);
void integer_rows_avxvnni(const Problem& p, int row_begin, int row_end);
void integer_rows_avx512vnni(const Problem& p, int row_begin, int row_end);
#endif
#if defined(__aarch64__)
void integer_rows_neon(const Problem& p, int row_begin, int row_end);
#endif

// Rows [row_begin, row_end) of out, for every input row. One function per instruction set.
void rows_scalar(const Problem& p, int row_begin, int row_end);
#if defined(__x86_64__) || defined(_M_X64)
void rows_avx2(const Problem& p, int row_begin, int row_end);
void rows_avx512(const Problem& p, int row_begin, int row_end);
#endif
#if defined(__aarch64__)
void rows_neon(const Problem& p, int row_begin, int row_end);
#endif

// Queries [query_begin, query_end) of heads [head, head + heads) of one batch row, heads that share one kv head
// (at most kHeadsTogether of them), over the keys of `segment`. One function per instruction set.
constexpr int kHeadsTogether = 4;
void attend_scalar(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                   const KeySegment& segment);
#if defined(__x86_64__) || defined(_M_X64)
void attend_avx2(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                 const KeySegment& segment);
void attend_avx512(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                   const KeySegment& segment);
#endif
#if defined(__aarch64__)
void attend_neon(const Attention& a, int row, int head, int heads, int query_begin, int query_end,
                 const KeySegment& segment);
#endif

// The same over quantized keys and values. One function per instruction set.
void attend_quantized_scalar(const QuantizedAttention& a, int row, int head, int heads, int query_begin, int query_end,
                             const KeySegment& segment);
#if defined(__x86_64__) || defined(_M_X64)
void attend_quantized_avx2(const QuantizedAttention& a, int row, int head, int heads, int query_begin, int query_end,
                           const KeySegment& segment);
void attend_quantized_avx512(const QuantizedAttention& a, int row, int head, int heads, int query_begin,
                             int query_end, const KeySegment& segment);
#endif
#if defined(__aarch64__)
void attend_quantized_neon(const QuantizedAttention& a, int row, int head, int heads, int query_begin, int query_end,
                           const KeySegment& segment);
#endif

// out[i] = silu(x[i]) for i in [begin, end). One function per instruction set.
void silu_scalar(const float* x, float* out, int64_t begin, int64_t end);
#if defined(__x86_64__) || defined(_M_X64)
void silu_avx2(const float* x, float* out, int64_t begin, int64_t end);
void silu_avx512(const float* x, float* out, int64_t begin, int64_t end);
#endif
#if defined(__aarch64__)
void silu_neon(const float* x, float* out, int64_t begin, int64_t end);
#endif

// Heads [begin, end) of the gated delta rule's one-token step (delta.h). One function per instruction set.
struct DeltaHeads;
void delta_heads_scalar(const DeltaHeads& d, int begin, int end);
#if defined(__x86_64__) || defined(_M_X64)
void delta_heads_avx2(const DeltaHeads& d, int begin, int end);
void delta_heads_avx512(const DeltaHeads& d, int begin, int end);
#endif
#if defined(__aarch64__)
void delta_heads_neon(const DeltaHeads& d, int begin, int end);
#endif

// out[i] = x[i] as float16 for i in [0, n) (`halves_range`). One function per instruction set.
void halves_scalar(const float* x, Half* out, int64_t n);
#if defined(__x86_64__) || defined(_M_X64)
void halves_avx2(const float* x, Half* out, int64_t n);
void halves_avx512(const float* x, Half* out, int64_t n);
#endif
#if defined(__aarch64__)
void halves_neon(const float* x, Half* out, int64_t n);
#endif

// Weight rows [row_begin, row_end) of a packed product, dequantized to float32 into `dst` (K floats a row, each
// chunk of 32 in the order prepare_inputs gives x). One function per instruction set.
void dequantize_scalar(const Problem& p, int row_begin, int row_end, float* dst);
#if defined(__x86_64__) || defined(_M_X64)
void dequantize_avx2(const Problem& p, int row_begin, int row_end, float* dst);
void dequantize_avx512(const Problem& p, int row_begin, int row_end, float* dst);
#endif
#if defined(__aarch64__)
void dequantize_neon(const Problem& p, int row_begin, int row_end, float* dst);
#endif

// Panels [panel_begin, panel_end) of x (M x K) for `gemm`, and output columns [row_begin, row_end) of a
// product from them. One pair per instruction set, with its panel height.
void pack_scalar(const float* x, int M, int K, float* panels, int panel_begin, int panel_end);
void gemm_scalar(const Gemm& g, int row_begin, int row_end);
#if defined(__x86_64__) || defined(_M_X64)
void pack_avx2(const float* x, int M, int K, float* panels, int panel_begin, int panel_end);
void gemm_avx2(const Gemm& g, int row_begin, int row_end);
void pack_avx512(const float* x, int M, int K, float* panels, int panel_begin, int panel_end);
void gemm_avx512(const Gemm& g, int row_begin, int row_end);
#endif
#if defined(__aarch64__)
void pack_neon(const float* x, int M, int K, float* panels, int panel_begin, int panel_end);
void gemm_neon(const Gemm& g, int row_begin, int row_end);
#endif

}  // namespace minimlx_native
