// Decode steps' feed-forward parts over weights held as GGUF blocks, each in one op where MLX runs several, each of
// which it schedules onto its CPU stream's thread, and each input row quantized once for all the products that read it:
// - `block_moe`: a mixture of experts (the router's scores and choice, the chosen experts' SwiGLU products, their
//   weighted sum, the shared expert's SwiGLU), where MLX runs about 25 ops and quantized a row once per chosen expert;
// - `block_geglu`: Gemma's GeGLU gated product (gate, up, the tanh GELU); `geglu` its gate alone, a prompt's;
// - `block_layer_input`: Gemma 4's per-layer input after a block (gate, GELU, the layer's own input, projection, norm,
//   residual, scalar), where MLX runs nine.
// Included by primitives.cpp after its namespace, whose block products' helpers it uses.
#pragma once

#include <optional>
#include <tuple>

#include "exp.h"

namespace minimlx_native {

// The router's choice for one row: logits = W x (float32, E x K), scores = sigmoid(logits) or softmax(logits), the k
// experts of the largest scores + score_bias (the bias chooses only), their weights the unbiased scores, renormalised
// to sum to 1 with `normalize`, times `scale`.
struct MoeRouting {
  int k;
  bool sigmoid, normalize;
  float scale;
};

void route_row(const float* x, const float* router, const float* score_bias, int E, int K, const MoeRouting& r,
               int* chosen, float* weights) {
  thread_local std::vector<float> scores, choice;
  scores.resize(E);
  choice.resize(E);
  for (int e = 0; e < E; ++e) {  // 16 partial sums, added in a fixed order
    const float* w = router + static_cast<int64_t>(e) * K;
    float partial[16] = {};
    int i = 0;
    for (; i + 16 <= K; i += 16)
      for (int j = 0; j < 16; ++j) partial[j] += x[i + j] * w[i + j];
    for (; i < K; ++i) partial[0] += x[i] * w[i];
    float total = 0.0f;
    for (float p : partial) total += p;
    scores[e] = total;
  }
  if (r.sigmoid) {
    for (float& s : scores) s = 1.0f / (1.0f + std::exp(-s));
  } else {
    const float high = *std::max_element(scores.begin(), scores.end());
    float total = 0.0f;
    for (float& s : scores) total += (s = std::exp(s - high));
    for (float& s : scores) s /= total;
  }
  for (int e = 0; e < E; ++e) choice[e] = scores[e] + (score_bias ? score_bias[e] : 0.0f);
  std::vector<int> order(E);
  for (int e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + r.k, order.end(),
                    [&](int a, int b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
  float total = 0.0f;
  for (int j = 0; j < r.k; ++j) {
    chosen[j] = order[j];
    total += weights[j] = scores[order[j]];
  }
  for (int j = 0; j < r.k; ++j) weights[j] = (r.normalize ? weights[j] / (total + 1e-20f) : weights[j]) * r.scale;
}

// The block products of `products` (their w, type, out, sizes and inputs set) in one pass over the pool: their blocks
// of weight rows claimed from one counter, integer or (`exact`) float32 rows.
void run_block_problems(const std::vector<BlockProblem>& products, bool exact) {
  std::vector<int> first_block{0}, rows;  // the caller's, read by the pool's threads
  for (const BlockProblem& p : products) {
    rows.push_back(block_product_rows(p));
    first_block.push_back(first_block.back() + (p.N + rows.back() - 1) / rows.back());
  }
  const auto rows_of = exact ? kIsa.blocks.float_rows : kIsa.blocks.rows;
  share(first_block.back(), [&](int b) {
    const int i = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin()) - 1;
    const int begin = (b - first_block[i]) * rows[i];
    rows_of(products[i], begin, std::min(products[i].N, begin + rows[i]));
  });
}

// Row m of quantized inputs of K values a row.
QuantizedBlockInputs quantized_row(const QuantizedBlockInputs& q, int64_t m, int K) {
  return q.xq == nullptr ? q : q.from_row(static_cast<int>(m), K);
}

// The product of one input row (row m of xf, K values, quantized as row m of q) by weight w (N rows of `type`).
BlockProblem row_problem(const uint8_t* w, int64_t row_bytes, int type, int N, int K, float* out, const float* xf,
                         const QuantizedBlockInputs& q, int64_t m) {
  return BlockProblem{w, row_bytes, type, quantized_row(q, m, K), out, 1, N, K, xf + m * K};
}

// Inputs: x (M, K) float32, the router's weight (E, K) float32, its score bias (E) float32 when `biased`, the experts'
// gate and up (E, H, row bytes) and down (E, K, row bytes) uint8, and with `shared` the shared expert's gate and up
// (S, row bytes) and down (K, row bytes). `types`: the ggml types of gate, up, down (and the shared gate, up, down).
// out (M, K): sum_j weight_j down_j(silu(gate_j x) * up_j x) + the shared expert's down(silu(gate x) * up x).
Work block_moe_work(MoeRouting routing, std::vector<int> types, bool biased, bool shared, bool exact) {
  return [routing, types, biased, shared, exact](const std::vector<mx::array>& in, mx::array& out) {
    const mx::array& x = in[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), k = routing.k, pairs = M * k;
    const int first = biased ? 3 : 2;
    const mx::array &gate = in[first], &up = in[first + 1], &down = in[first + 2];
    const int E = gate.shape(0), H = gate.shape(1), S = shared ? in[first + 3].shape(0) : 0;
    thread_local Floats copy, hidden, gated, downs, shared_hidden, shared_gated, shared_down;
    thread_local QuantizedBlocks quantized, quantized_hidden, quantized_shared;
    thread_local std::vector<int> chosen;
    thread_local std::vector<float> weights;
    thread_local std::vector<BlockProblem> products;
    const float* xs = contiguous(x, copy);
    chosen.resize(pairs);
    weights.resize(pairs);
    for (int m = 0; m < M; ++m)
      route_row(xs + static_cast<int64_t>(m) * K, in[1].data<float>(), biased ? in[2].data<float>() : nullptr, E, K,
                routing, chosen.data() + m * k, weights.data() + m * k);
    auto expert = [](const mx::array& w, int e) {
      return w.data<uint8_t>() + e * static_cast<int64_t>(w.shape(1)) * w.shape(2);
    };
    // gate and up of every (row, chosen expert), and the shared expert's of every row, each row quantized once
    QuantizedBlockInputs qx{}, qh{}, qs{};
    if (!exact) {
      quantized.quantize(xs, M, K);
      qx = quantized.inputs();
    }
    hidden.resize(static_cast<size_t>(pairs) * H);
    gated.resize(hidden.size());
    shared_hidden.resize(static_cast<size_t>(M) * S);
    shared_gated.resize(shared_hidden.size());
    products.clear();
    for (int at = 0; at < pairs; ++at) {
      const int e = chosen[at], m = at / k;
      products.push_back(row_problem(expert(gate, e), gate.shape(2), types[0], H, K, gated.data() + int64_t{at} * H,
                                     xs, qx, m));
      products.push_back(row_problem(expert(up, e), up.shape(2), types[1], H, K, hidden.data() + int64_t{at} * H, xs,
                                     qx, m));
    }
    for (int m = 0; m < M && shared; ++m) {
      const mx::array &g = in[first + 3], &u = in[first + 4];
      products.push_back(row_problem(g.data<uint8_t>(), g.shape(1), types[3], S, K,
                                     shared_gated.data() + int64_t{m} * S, xs, qx, m));
      products.push_back(row_problem(u.data<uint8_t>(), u.shape(1), types[4], S, K,
                                     shared_hidden.data() + int64_t{m} * S, xs, qx, m));
    }
    run_block_problems(products, exact);
    apply_gate(gated.data(), hidden.data(), pairs, H, 0, H);
    if (shared) apply_gate(shared_gated.data(), shared_hidden.data(), M, S, 0, S);
    // down of every (row, chosen expert) from its hidden row, quantized once; the shared expert's
    downs.resize(static_cast<size_t>(pairs) * K);
    shared_down.resize(static_cast<size_t>(M) * (shared ? K : 0));
    if (!exact) {
      quantized_hidden.quantize(hidden.data(), pairs, H);
      qh = quantized_hidden.inputs();
      if (shared) {
        quantized_shared.quantize(shared_hidden.data(), M, S);
        qs = quantized_shared.inputs();
      }
    }
    products.clear();
    for (int at = 0; at < pairs; ++at)
      products.push_back(row_problem(expert(down, chosen[at]), down.shape(2), types[2], K, H,
                                     downs.data() + int64_t{at} * K, hidden.data(), qh, at));
    for (int m = 0; m < M && shared; ++m) {
      const mx::array& d = in[first + 5];
      products.push_back(row_problem(d.data<uint8_t>(), d.shape(1), types[5], K, S,
                                     shared_down.data() + int64_t{m} * K, shared_hidden.data(), qs, m));
    }
    run_block_problems(products, exact);
    float* y = out.data<float>();
    for (int m = 0; m < M; ++m) {
      float* row = y + static_cast<int64_t>(m) * K;
      std::fill(row, row + K, 0.0f);
      for (int j = 0; j < k; ++j) {
        const float w = weights[m * k + j];
        const float* d = downs.data() + static_cast<int64_t>(m * k + j) * K;
        for (int i = 0; i < K; ++i) row[i] += w * d[i];
      }
      if (shared)
        for (int i = 0; i < K; ++i) row[i] += shared_down[static_cast<int64_t>(m) * K + i];
    }
  };
}

// block_moe_work's op, checked: x (..., K) float32, out of x's shape.
mx::array block_moe(const mx::array& x, const mx::array& router, const std::optional<mx::array>& score_bias,
                    const std::vector<mx::array>& experts, const std::vector<mx::array>& shared,
                    const std::vector<int>& types, int k, bool sigmoid, bool normalize, float scale, bool exact) {
  const std::string name = "minimlx_native.block_moe";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  if (x.dtype() != mx::float32 || x.ndim() < 1) fail("x must be float32, at least 1-D");
  const int K = x.shape(-1);
  if (experts.size() != 3 || (!shared.empty() && shared.size() != 3))
    fail("experts (and shared, where given) must be [gate, up, down]");
  if (types.size() != 3 + shared.size()) fail("types must be the ggml types of the experts' (and shared) weights");
  for (size_t i = 0; i < 3; ++i)
    if (experts[i].dtype() != mx::uint8 || experts[i].ndim() != 3)
      fail("the experts' weights must be (experts, rows, row bytes) uint8");
  const int E = experts[0].shape(0), H = experts[0].shape(1);
  if (router.dtype() != mx::float32 || router.shape() != mx::Shape{E, K}) fail("router must be float32 (experts, K)");
  if (score_bias && (score_bias->dtype() != mx::float32 || score_bias->shape() != mx::Shape{E}))
    fail("score_bias must be float32 (experts,)");
  if (k < 1 || k > E) fail("k must be between 1 and the number of experts");
  auto rows_of = [&](const mx::array& w, int type, int N, int features, const char* what) {
    const int bytes = block_bytes(type);
    if (bytes == 0 || w.shape(-1) % bytes || w.shape(-1) / bytes * block_values(type) != features ||
        w.shape(-2) != N || (w.ndim() == 3 && w.shape(0) != E))
      fail(std::string(what) + " must hold " + std::to_string(N) + " rows of " + std::to_string(features) +
           " features as GGUF blocks of its type");
  };
  rows_of(experts[0], types[0], H, K, "the experts' gate");
  rows_of(experts[1], types[1], H, K, "the experts' up");
  rows_of(experts[2], types[2], K, H, "the experts' down");
  if (!shared.empty()) {
    for (const auto& w : shared)
      if (w.dtype() != mx::uint8 || w.ndim() != 2) fail("the shared expert's weights must be (rows, row bytes) uint8");
    const int S = shared[0].shape(0);
    rows_of(shared[0], types[3], S, K, "the shared gate");
    rows_of(shared[1], types[4], S, K, "the shared up");
    rows_of(shared[2], types[5], K, S, "the shared down");
  }
  std::vector<mx::array> inputs{x, router};
  if (score_bias) inputs.push_back(*score_bias);
  inputs.insert(inputs.end(), experts.begin(), experts.end());
  inputs.insert(inputs.end(), shared.begin(), shared.end());
  const MoeRouting routing{k, sigmoid, normalize, scale};
  std::vector<float> params{static_cast<float>(k), sigmoid ? 1.0f : 0.0f, normalize ? 1.0f : 0.0f, scale,
                            exact ? 1.0f : 0.0f, score_bias ? 1.0f : 0.0f};
  for (int t : types) params.push_back(static_cast<float>(t));
  return cpu_op("MinimlxNativeBlockMoe", params,
                block_moe_work(routing, types, score_bias.has_value(), !shared.empty(), exact), std::move(inputs));
}

// gelu(gate) * up for GELU's tanh form, gelu(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), written as
// g sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)), into up; n values.
void apply_gelu_gate(const float* gate, float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    up[i] *= g / (1.0f + exp_clamped(-1.5957691216057308f * (g + 0.044715f * g * g * g)));
  }
}

// gelu(gate) * up elementwise (GELU's tanh form) for float32 arrays of one shape: a prompt's GeGLU gate, after its
// products.
mx::array geglu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape())
    throw std::invalid_argument("minimlx_native.geglu: gate and up must be float32 arrays of one shape");
  Work work = [](const std::vector<mx::array>& in, mx::array& out) {
    thread_local Floats gate_copy, up_copy;
    const float *g = contiguous(in[0], gate_copy), *u = contiguous(in[1], up_copy);
    const int64_t n = static_cast<int64_t>(out.size());
    float* y = out.data<float>();
    constexpr int64_t kChunk = 1 << 14;  // values per block of the pool's
    share(static_cast<int>((n + kChunk - 1) / kChunk), [&, g, u, y](int b) {
      const int64_t begin = b * kChunk, end = std::min(n, begin + kChunk);
      std::copy(u + begin, u + end, y + begin);
      apply_gelu_gate(g + begin, y + begin, end - begin);
    });
  };
  return cpu_op("MinimlxNativeGeglu", {}, work, {gate, up});
}

// gelu(x @ gate.T) * (x @ up.T) (GELU's tanh form: Gemma's GeGLU) for a few rows of x, weights held as GGUF blocks of
// as many rows, both products from each row quantized once (unless `exact`), in one pass over the pool.
Work block_geglu_work(int gate_type, int up_type, bool exact) {
  return [gate_type, up_type, exact](const std::vector<mx::array>& in, mx::array& out) {
    const mx::array& x = in[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K), N = in[1].shape(0);
    thread_local Floats copy, gated;
    thread_local QuantizedBlocks quantized;
    const float* xs = contiguous(x, copy);
    QuantizedBlockInputs qx{};
    if (!exact) {
      quantized.quantize(xs, M, K);
      qx = quantized.inputs();
    }
    gated.resize(static_cast<size_t>(M) * N);
    float* y = out.data<float>();
    std::vector<BlockProblem> products;
    for (int m = 0; m < M; ++m) {
      products.push_back(row_problem(in[1].data<uint8_t>(), in[1].shape(1), gate_type, N, K, gated.data() + int64_t{m} * N,
                                     xs, qx, m));
      products.push_back(row_problem(in[2].data<uint8_t>(), in[2].shape(1), up_type, N, K, y + int64_t{m} * N, xs, qx, m));
    }
    run_block_problems(products, exact);
    apply_gelu_gate(gated.data(), y, static_cast<int64_t>(M) * N);
  };
}

mx::array block_geglu(const mx::array& x, const mx::array& gate_w, int gate_type, const mx::array& up_w, int up_type,
                      bool exact) {
  const std::string name = "minimlx_native.block_geglu";
  if (x.dtype() != mx::float32 || x.ndim() < 1) throw std::invalid_argument(name + ": x must be float32, at least 1-D");
  for (auto [w, type] : {std::pair{&gate_w, gate_type}, std::pair{&up_w, up_type}})
    if (block_features(name, *w, type) != x.shape(-1))
      throw std::invalid_argument(name + ": the weights' rows hold a number of features other than x's " +
                                  std::to_string(x.shape(-1)));
  if (gate_w.shape(0) != up_w.shape(0)) throw std::invalid_argument(name + ": the gate and up weights must have as many rows");
  auto shape = x.shape();
  shape.back() = up_w.shape(0);
  return cpu_op("MinimlxNativeBlockGeglu",
                {exact ? 1.0f : 0.0f, static_cast<float>(gate_type), static_cast<float>(up_type)},
                block_geglu_work(gate_type, up_type, exact), {x, gate_w, up_w}, shape);
}

// Gemma 4's per-layer input after a block, for a few rows: (h + rms_norm(proj(gelu(gate(h)) * own)) * weight) * scalar,
// gelu the tanh form, gate and proj held as GGUF blocks, each product's input quantized once (unless `exact`). Inputs:
// h (M, D) float32, gate (I, row bytes), proj (D, row bytes), own (M, I) float32, the norm's weight (D) float32 and
// the scalar (1) float32; out (M, D).
Work block_layer_input_work(int gate_type, int proj_type, float eps, bool exact) {
  return [gate_type, proj_type, eps, exact](const std::vector<mx::array>& in, mx::array& out) {
    const mx::array &h = in[0], &gate = in[1], &proj = in[2];
    const int D = h.shape(-1), M = static_cast<int>(h.size() / D), I = gate.shape(0);
    thread_local Floats h_copy, own_copy, gated, projected;
    thread_local QuantizedBlocks quantized;
    const float* hs = contiguous(h, h_copy);
    const float* own = contiguous(in[3], own_copy);
    gated.resize(static_cast<size_t>(M) * I);
    projected.resize(static_cast<size_t>(M) * D);
    QuantizedBlockInputs q{};
    if (!exact) {
      quantized.quantize(hs, M, D);
      q = quantized.inputs();
    }
    std::vector<BlockProblem> products;
    for (int m = 0; m < M; ++m)
      products.push_back(row_problem(gate.data<uint8_t>(), gate.shape(1), gate_type, I, D, gated.data() + int64_t{m} * I,
                                     hs, q, m));
    run_block_problems(products, exact);
    std::vector<float> gated_own(gated.size());  // gelu(gate) * own: the GeGLU gate, own for up
    std::copy(own, own + gated.size(), gated_own.begin());
    apply_gelu_gate(gated.data(), gated_own.data(), static_cast<int64_t>(gated.size()));
    if (!exact) {
      quantized.quantize(gated_own.data(), M, I);
      q = quantized.inputs();
    }
    products.clear();
    for (int m = 0; m < M; ++m)
      products.push_back(row_problem(proj.data<uint8_t>(), proj.shape(1), proj_type, D, I,
                                     projected.data() + int64_t{m} * D, gated_own.data(), q, m));
    run_block_problems(products, exact);
    const float *weight = in[4].data<float>(), scalar = in[5].data<float>()[0];
    float* y = out.data<float>();
    for (int m = 0; m < M; ++m) {
      const float* p = projected.data() + static_cast<int64_t>(m) * D;
      const float* x = hs + static_cast<int64_t>(m) * D;
      const float inverse = 1.0f / std::sqrt(sum_of_squares(p, D) / static_cast<float>(D) + eps);
      for (int d = 0; d < D; ++d) y[int64_t{m} * D + d] = (x[d] + p[d] * inverse * weight[d]) * scalar;
    }
  };
}

mx::array block_layer_input(const mx::array& h, const mx::array& gate_w, int gate_type, const mx::array& proj_w,
                            int proj_type, const mx::array& own, const mx::array& norm_weight, float eps,
                            const mx::array& scalar, bool exact) {
  const std::string name = "minimlx_native.block_layer_input";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  if (h.dtype() != mx::float32 || h.ndim() < 1) fail("h must be float32, at least 1-D");
  const int D = h.shape(-1);
  if (block_features(name, gate_w, gate_type) != D) fail("the gate's rows must hold h's features");
  const int I = gate_w.shape(0);
  if (block_features(name, proj_w, proj_type) != I || proj_w.shape(0) != D)
    fail("proj must map the gate's outputs to h's features");
  if (own.dtype() != mx::float32 || own.size() != h.size() / D * I) fail("own must be float32, one input a row of h");
  if (norm_weight.dtype() != mx::float32 || norm_weight.shape() != mx::Shape{D}) fail("the norm's weight must be float32 (D,)");
  if (scalar.dtype() != mx::float32 || scalar.size() != 1) fail("scalar must be float32, one value");
  return cpu_op("MinimlxNativeBlockLayerInput",
                {exact ? 1.0f : 0.0f, static_cast<float>(gate_type), static_cast<float>(proj_type), eps},
                block_layer_input_work(gate_type, proj_type, eps, exact), {h, gate_w, proj_w, own, norm_weight, scalar});
}

}  // namespace minimlx_native
