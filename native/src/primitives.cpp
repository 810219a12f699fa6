// The MLX primitives of minimlx_native, each evaluated on the CPU by the instruction set chosen at import and
// split between the threads of one pool: `quantized_matmul` (x @ dequantize(w, scales, biases).T reading the
// packed weight directly, see kernel.h), `causal_attention` (attention.h) and `silu` (exp.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "kernel.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace minimlx_native {

// The kernels of one instruction set.
struct Isa {
  void (*rows)(const Problem&, int, int);
  void (*attend)(const Attention&, int, int, int, int);
  void (*silu)(const float*, float*, int64_t, int64_t);
  const char* name;
};

// The widest instruction set this CPU runs, chosen once.
Isa best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    return {rows_avx512, attend_avx512, silu_avx512, "avx512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {rows_avx2, attend_avx2, silu_avx2, "avx2"};
#elif defined(__aarch64__)
  return {rows_neon, attend_neon, silu_neon, "neon"};
#endif
  return {rows_scalar, attend_scalar, silu_scalar, "scalar"};
}

const Isa kIsa = best_isa();

// The elements of `a` (any strides) in row-major order, contiguous from `dst`.
void gather(const mx::array& a, float* dst) {
  const float* src = a.data<float>();
  if (a.flags().row_contiguous) {
    std::copy(src, src + a.size(), dst);
    return;
  }
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t offset = 0;
    size_t rest = i;
    for (int d = a.ndim() - 1; d >= 0; --d) {
      offset += static_cast<int64_t>(rest % shape[d]) * strides[d];
      rest /= shape[d];
    }
    dst[i] = src[offset];
  }
}

// A fixed set of worker threads that help the calling thread through the blocks of one job. Blocks are
// claimed from a shared counter, so a worker that the OS has not scheduled yet costs nothing: the
// caller takes its blocks, and waits only for blocks that a running worker has already claimed.
// A worker that finished a job polls for the next one for kSpin before it sleeps: the products of one
// decode step come tens of microseconds apart, and waking a sleeping thread took about as long as a
// small product (576 x 576 at 4 bits: 63 us per call with sleeping workers, 31 us with polling ones).
// It polls with yield(), so under load it hands its core to whoever needs it.
constexpr auto kSpin = std::chrono::microseconds(200);

class Pool {
 public:
  explicit Pool(int size) {
    for (int i = 1; i < size; ++i) threads_.emplace_back([this] { work(); });
  }
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  void run(int blocks, const std::function<void(int)>& block) {
    std::lock_guard<std::mutex> one_job_at_a_time(running_);
    auto job = std::make_shared<Job>(blocks, block);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      jobs_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->help();
    while (job->done.load(std::memory_order_acquire) < blocks) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mutex_);
    job_.reset();
  }

 private:
  struct Job {
    Job(int blocks, const std::function<void(int)>& block) : blocks(blocks), block(block) {}
    void help() {
      for (int b; (b = next.fetch_add(1)) < blocks;) {
        block(b);
        done.fetch_add(1, std::memory_order_release);
      }
    }
    const int blocks;
    const std::function<void(int)>& block;  // valid while some block is unfinished
    std::atomic<int> next{0}, done{0};
  };

  void work() {
    std::shared_ptr<Job> seen;
    uint64_t jobs_seen = 0;
    while (true) {
      std::shared_ptr<Job> job;
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (jobs_.load(std::memory_order_acquire) == jobs_seen && std::chrono::steady_clock::now() < until)
        std::this_thread::yield();
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return job_ && job_ != seen; });
        job = seen = job_;
        jobs_seen = jobs_.load(std::memory_order_relaxed);
      }
      job->help();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex running_, mutex_;
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> jobs_{0};
};

int thread_count() {
  if (const char* env = std::getenv("MINIMLX_NATIVE_THREADS")) return std::max(1, std::atoi(env));
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  static Pool* instance = new Pool(thread_count());  // never destroyed: workers sleep until exit
  return *instance;
}

// Output rows per block: about 32 KB of packed weights times input rows, so that a product is split
// finely enough to balance threads and coarsely enough that claiming a block costs nothing; at least
// 8 rows (a few KB of weights, reused from L1 by every input row).
constexpr int64_t kBlockBytes = 32 * 1024;

void run(const Problem& p) {
  const int64_t row_work = static_cast<int64_t>(p.K) * p.bits / 8 * p.M;
  const int rows = static_cast<int>(std::max<int64_t>(8, kBlockBytes / std::max<int64_t>(1, row_work)));
  const int blocks = (p.N + rows - 1) / rows;
  if (blocks == 1 || pool().size() == 1) return kIsa.rows(p, 0, p.N);
  pool().run(blocks, [&](int b) { kIsa.rows(p, b * rows, std::min(p.N, (b + 1) * rows)); });
}

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                      scales = mx::array::unsafe_weak_copy(inputs[2]),
                      biases = mx::array::unsafe_weak_copy(inputs[3]), out = mx::array::unsafe_weak_copy(out),
                      group_size = group_size_, bits = bits_]() mutable {
      const int K = x.shape(-1), N = w.shape(0), M = static_cast<int>(x.size() / K);
      thread_local std::vector<float> rows, prepared, sums;
      rows.resize(static_cast<size_t>(M) * K);
      gather(x, rows.data());
      prepared.resize(rows.size());
      sums.resize(static_cast<size_t>(M) * (K / group_size));
      prepare_inputs(rows.data(), M, K, group_size, bits, prepared.data(), sums.data());
      run(Problem{prepared.data(), sums.data(), reinterpret_cast<const uint8_t*>(w.data<uint32_t>()),
                  scales.data<float>(), biases.data<float>(), out.data<float>(), M, N, K, group_size, bits});
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("minimlx_native.quantized_matmul runs on the CPU only");
  }

  const char* name() const override { return "MinimlxNativeQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_, bits_;
};

// Queries per block of work: enough that claiming a block costs nothing, few enough that the two cores
// of a 128-token chunk of 9 heads get 72 blocks to share.
constexpr int kQueryBlock = 16;

class CausalAttention : public mx::UnaryPrimitive {
 public:
  CausalAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]), k = mx::array::unsafe_weak_copy(inputs[1]),
                      v = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
                      scale = scale_]() mutable {
      thread_local std::vector<float> copies[3];
      Attention a{nullptr, nullptr, nullptr, out.data<float>(), {}, {}, {}, q.shape(0), q.shape(1), k.shape(1),
                  q.shape(2), k.shape(2), q.shape(3), scale};
      a.q = rows(q, a.q_strides, copies[0]);
      a.k = rows(k, a.k_strides, copies[1]);
      a.v = rows(v, a.v_strides, copies[2]);
      const int blocks_per_head = (a.queries + kQueryBlock - 1) / kQueryBlock;
      const int blocks = a.batch * a.heads * blocks_per_head;
      auto block = [&](int b) {
        const int head_row = b / blocks_per_head, first = b % blocks_per_head * kQueryBlock;
        kIsa.attend(a, head_row / a.heads, head_row % a.heads, first, std::min(a.queries, first + kQueryBlock));
      };
      if (blocks == 1 || pool().size() == 1) {
        for (int b = 0; b < blocks; ++b) block(b);
      } else {
        pool().run(blocks, block);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("minimlx_native.causal_attention runs on the CPU only");
  }

  const char* name() const override { return "MinimlxNativeCausalAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const CausalAttention&>(other).scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  // The data of a 4-D array and its first three strides, in floats; rows whose last step is not one float
  // are first copied into `copy`, contiguous.
  static const float* rows(const mx::array& a, int64_t* strides, std::vector<float>& copy) {
    const auto& step = a.strides();
    if (step[3] == 1) {
      std::copy(step.begin(), step.begin() + 3, strides);
      return a.data<float>();
    }
    const auto& shape = a.shape();
    copy.resize(a.size());
    gather(a, copy.data());
    strides[2] = shape[3];
    strides[1] = strides[2] * shape[2];
    strides[0] = strides[1] * shape[1];
    return copy.data();
  }

  float scale_;
};

// Elements per block of work: large enough that claiming one costs nothing next to its exponentials.
constexpr int64_t kSiluBlock = 16 * 1024;

class Silu : public mx::UnaryPrimitive {
 public:
  explicit Silu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), out = mx::array::unsafe_weak_copy(out)]() mutable {
      thread_local std::vector<float> copy;
      const float* src = x.data<float>();
      if (!x.flags().row_contiguous) {
        copy.resize(x.size());
        gather(x, copy.data());
        src = copy.data();
      }
      const int64_t n = static_cast<int64_t>(x.size());
      const int blocks = static_cast<int>((n + kSiluBlock - 1) / kSiluBlock);
      float* dst = out.data<float>();
      if (blocks <= 1 || pool().size() == 1) return kIsa.silu(src, dst, 0, n);
      pool().run(blocks, [&](int b) { kIsa.silu(src, dst, b * kSiluBlock, std::min(n, (b + 1) * kSiluBlock)); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("minimlx_native.silu runs on the CPU only");
  }

  const char* name() const override { return "MinimlxNativeSilu"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

mx::array silu(const mx::array& x) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("minimlx_native.silu: x must be float32");
  return mx::array(x.shape(), mx::float32, std::make_shared<Silu>(mx::default_stream(mx::Device::cpu)), {x});
}

mx::array causal_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("minimlx_native.causal_attention: " + what); };
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) fail("q, k and v must be float32");
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape()) fail("q must be 4-D and k, v of one 4-D shape");
  const int head_dim = q.shape(3);
  if (k.shape(0) != q.shape(0) || k.shape(3) != head_dim || k.shape(1) == 0 || q.shape(1) % k.shape(1))
    fail("k and v must have q's batch and head_dim, and a number of heads that divides q's");
  if (head_dim % 16) fail("head_dim must be a multiple of 16, not " + std::to_string(head_dim));
  if (k.shape(2) < q.shape(2)) fail("there must be at least as many keys as queries");
  const auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(q.shape(), mx::float32, std::make_shared<CausalAttention>(stream, scale), {q, k, v});
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("minimlx_native.quantized_matmul: " + what); };
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8, not " + std::to_string(bits));
  if (group_size <= 0 || group_size % 32) fail("group_size must be a multiple of 32, not " + std::to_string(group_size));
  if (x.dtype() != mx::float32 || scales.dtype() != mx::float32 || biases.dtype() != mx::float32)
    fail("x, scales and biases must be float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || x.ndim() < 1) fail("w must be a 2-D uint32 array and x at least 1-D");
  const int K = x.shape(-1), N = w.shape(0);
  if (K % group_size || static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(K) * bits)
    fail("w's packed width does not hold x's " + std::to_string(K) + " features at " + std::to_string(bits) + " bits");
  const mx::Shape groups{N, K / group_size};
  if (scales.shape() != groups || biases.shape() != groups) fail("scales and biases must have shape (N, K / group_size)");
  auto shape = x.shape();
  shape.back() = N;
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatmul>(stream, group_size, bits), {x, w, scales, biases});
}

}  // namespace minimlx_native

NB_MODULE(_ext, m) {
  m.doc() = "Quantized matrix products for MLX's CPU backend, reading affine-packed weights directly.";
  m.def("quantized_matmul", &minimlx_native::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x @ dequantize(w, scales, biases, group_size, bits).T for float32 x (..., K), w (N, K * bits / 32) "
        "uint32, float32 scales and biases (N, K / group_size); bits 4 or 8, group_size a multiple of 32.");
  m.def("causal_attention", &minimlx_native::causal_attention, "q"_a, "k"_a, "v"_a, "scale"_a,
        "softmax(q k^T * scale) v with a causal mask for float32 q (batch, heads, queries, head_dim) and k, v "
        "(batch, kv_heads, keys, head_dim), queries being the last of the keys' positions; head_dim a multiple "
        "of 16, heads a multiple of kv_heads.");
  m.def("silu", &minimlx_native::silu, "x"_a, "x * sigmoid(x) for float32 x, elementwise.");
  m.attr("isa") = minimlx_native::kIsa.name;
  m.attr("threads") = minimlx_native::pool().size();
  m.attr("mlx_version") = MINIMLX_NATIVE_MLX_VERSION;
}
