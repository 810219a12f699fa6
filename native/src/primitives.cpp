// The MLX primitives of minimlx_native, each evaluated on the CPU by the instruction set chosen at import and
// split between the threads of one pool: `quantized_matmul` (x @ dequantize(w, scales, biases).T reading the
// packed weight directly, see kernel.h), `causal_attention` (attention.h), `silu` (exp.h) and the ops of a
// decode step MLX composes of several on the CPU (rms_norm, rotate).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#if defined(__aarch64__) && !defined(__APPLE__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "delta.h"
#include "kernel.h"
#include "kquant.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace minimlx_native {

// The integer products of one instruction set (integer.h): its row loop, the values of its step for 4-bit and for
// 8-bit codes and the float lanes of its sums, which `quantize_inputs` lays the inputs out for.
struct IntegerIsa {
  void (*rows)(const Problem&, int, int);
  void (*quantize)(const float*, int, int, int, int, int, bool, const QuantizedInputs&);
  int span4, span8, lanes;
  const char* name;
};

// The products with GGUF's block-quantized weights (kquant.h) of one instruction set.
struct BlockIsa {
  void (*rows)(const BlockProblem&, int, int);
  void (*float_rows)(const BlockProblem&, int, int);
  void (*dequantize)(const BlockProblem&, int, int, float*);
  const char* name;
  // A prompt's products in integers (kquant_gemm_avx512.h), weight rows [begin, end) in tiles of kGemmTileRows;
  // nullptr where the instruction set has none (prompts keep float32 inputs there).
  void (*gemm)(const BlockProblem&, const GemmInputs&, int, int) = nullptr;
};

// The kernels of one instruction set.
struct Isa {
  void (*rows)(const Problem&, int, int);
  void (*attend)(const Attention&, int, int, int, int, int, const KeySegment&);
  void (*attend_quantized)(const QuantizedAttention&, int, int, int, int, int, const KeySegment&);
  void (*silu)(const float*, float*, int64_t, int64_t);
  void (*halves)(const float*, Half*, int64_t);
  void (*dequantize)(const Problem&, int, int, float*);
  void (*pack)(const float*, int, int, float*, int, int);
  void (*gemm)(const Gemm&, int, int);
  int panel_rows;  // input rows per panel of `pack`: two vectors
  const char* name;
  IntegerIsa integer;
  BlockIsa blocks;
  void (*delta_heads)(const DeltaHeads&, int, int);
};

// The instruction sets by rank, widest last; MINIMLX_NATIVE_ISA names the widest to use (to run a narrower one
// than the CPU's best: the tests compare each with the portable code).
#if defined(__x86_64__) || defined(_M_X64)
const char* const kIsaNames[] = {"scalar", "avx2", "avxvnni", "avx512"};
#elif defined(__aarch64__)
const char* const kIsaNames[] = {"scalar", "neon"};
#else
const char* const kIsaNames[] = {"scalar"};
#endif

int widest_rank() {
  const int widest = static_cast<int>(std::size(kIsaNames)) - 1;
  const char* env = std::getenv("MINIMLX_NATIVE_ISA");
  if (env == nullptr || *env == 0) return widest;
  for (int rank = 0; rank <= widest; ++rank)
    if (std::string(env) == kIsaNames[rank]) return rank;
  std::string names;
  for (const char* name : kIsaNames) names += std::string(names.empty() ? "" : ", ") + name;
  throw std::invalid_argument("MINIMLX_NATIVE_ISA=" + std::string(env) + " is none of this build's: " + names);
}

// The widest instruction sets this CPU runs, up to MINIMLX_NATIVE_ISA's, chosen once: for the float kernels, and
// for the integer products (VNNI where the CPU has it).
Isa best_isa() {
  const int rank = widest_rank();
  const IntegerIsa scalar_integer{integer_rows_scalar, quantize_inputs, 32, 32, 1, "scalar"};
  const BlockIsa scalar_blocks{block_rows_scalar, float_block_rows_scalar, dequantize_blocks_scalar, "scalar"};
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = rank >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avxvnni = rank >= 2 && avx2 && __builtin_cpu_supports("avxvnni");
  const bool avx512 = rank >= 3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("f16c");
  const bool avx512vnni = avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  const BlockIsa blocks = avx512vnni ? BlockIsa{block_rows_avx512vnni, float_block_rows_avx512vnni,
                                               dequantize_blocks_avx512vnni, "avx512vnni", block_gemm_avx512vnni}
                          : avx2     ? BlockIsa{block_rows_avx2, float_block_rows_avx2, dequantize_blocks_avx2, "avx2"}
                                     : scalar_blocks;
  const IntegerIsa integer = avx512vnni ? IntegerIsa{integer_rows_avx512vnni, quantize_inputs_avx512vnni, 128, 64, 16,
                                                      "avx512vnni"}
                             : avxvnni  ? IntegerIsa{integer_rows_avxvnni, quantize_inputs_avx2, 64, 32, 8, "avxvnni"}
                             : avx2     ? IntegerIsa{integer_rows_avx2, quantize_inputs_avx2, 64, 32, 8, "avx2"}
                                        : scalar_integer;
  if (avx512)
    return {rows_avx512, attend_avx512, attend_quantized_avx512, silu_avx512, halves_avx512, dequantize_avx512,
            pack_avx512, gemm_avx512, 32, "avx512", integer, blocks, delta_heads_avx512};
  if (avx2)
    return {rows_avx2, attend_avx2, attend_quantized_avx2, silu_avx2, halves_avx2, dequantize_avx2, pack_avx2,
            gemm_avx2, 16, "avx2", integer, blocks, delta_heads_avx2};
#elif defined(__aarch64__)
#if defined(__APPLE__)
  const bool dotprod = true;  // every Apple arm64 CPU
#else
  const bool dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
  if (rank >= 1)
    return {rows_neon, attend_neon, attend_quantized_neon, silu_neon, halves_neon, dequantize_neon, pack_neon,
            gemm_neon, 8, "neon",
            dotprod ? IntegerIsa{integer_rows_neon, quantize_inputs, 32, 32, 4, "neondot"} : scalar_integer,
            scalar_blocks, delta_heads_neon};
#endif
  return {rows_scalar, attend_scalar, attend_quantized_scalar, silu_scalar, halves_scalar, dequantize_scalar,
          pack_scalar, gemm_scalar, 2, "scalar", scalar_integer, scalar_blocks, delta_heads_scalar};
}

const Isa kIsa = best_isa();

// The elements of `a` (any strides) in row-major order, contiguous from `dst`: a row at a time where the last
// axis is contiguous (a transposed view of heads and tokens), else one element at a time.
template <class T>
void gather(const mx::array& a, T* dst) {
  const T* src = a.data<T>();
  if (a.flags().row_contiguous) {
    std::copy(src, src + a.size(), dst);
    return;
  }
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int last = a.ndim() - 1;
  const bool rows = strides[last] == 1;
  const size_t width = rows ? shape[last] : 1;
  for (size_t i = 0; i < a.size(); i += width) {
    int64_t offset = 0;
    size_t rest = i;
    for (int d = last; d >= 0; --d) {
      offset += static_cast<int64_t>(rest % shape[d]) * strides[d];
      rest /= shape[d];
    }
    if (rows) {
      std::copy(src + offset, src + offset + width, dst + i);
    } else {
      dst[i] = src[offset];
    }
  }
}

using Floats = std::vector<float, CacheAligned<float>>;

// A fixed set of worker threads that help the calling thread through the blocks of one job. Blocks are
// claimed from a shared counter, so a worker that the OS has not scheduled yet costs nothing: the
// caller takes its blocks, and waits only for blocks that a running worker has already claimed.
// A worker that finished a job polls for the next one for kSpin before it sleeps: the products of one
// decode step come tens of microseconds apart, and waking a sleeping thread takes longer than a small product.
// It polls with yield(), so under load it hands its core to whoever needs it.
constexpr auto kSpin = std::chrono::microseconds(200);

// Blocks that a job runs before its own (`share`), all of them done before any of the job's starts: work each block
// of the job needs whole, shared out in the same pass over the pool rather than a pass of its own.
struct Phase {
  int blocks = 0;
  const std::function<void(int)>* block = nullptr;
};

class Pool {
 public:
  explicit Pool(int size) {
    for (int i = 1; i < size; ++i) threads_.emplace_back([this] { work(); });
  }
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  void run(const Phase& first, int blocks, const std::function<void(int)>& block) {
    std::lock_guard<std::mutex> one_job_at_a_time(running_);
    auto job = std::make_shared<Job>(first, blocks, block);
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
    Job(const Phase& first, int blocks, const std::function<void(int)>& block)
        : first(first), blocks(blocks), block(block) {}
    void help() {
      if (first.blocks > 0) {
        for (int b; (b = next_first.fetch_add(1)) < first.blocks;) {
          (*first.block)(b);
          done_first.fetch_add(1, std::memory_order_release);
        }
        while (done_first.load(std::memory_order_acquire) < first.blocks) std::this_thread::yield();
      }
      for (int b; (b = next.fetch_add(1)) < blocks;) {
        block(b);
        done.fetch_add(1, std::memory_order_release);
      }
    }
    const Phase first;
    const int blocks;
    const std::function<void(int)>& block;  // valid while some block is unfinished
    std::atomic<int> next_first{0}, done_first{0}, next{0}, done{0};
  };

  // Between jobs: poll for the next for kSpin, then sleep until one is published. A job that is over by the time
  // this thread looks (its caller took every block) sends it back to polling, not to sleep: a sleeping thread takes
  // longer to wake than a decode step's small product lasts, so it would miss the next job as well, and the next.
  void work() {
    uint64_t jobs_seen = 0;
    while (true) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (jobs_.load(std::memory_order_acquire) == jobs_seen) {
        if (std::chrono::steady_clock::now() >= until) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return jobs_.load(std::memory_order_relaxed) != jobs_seen; });
          break;
        }
        std::this_thread::yield();
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        job = job_;
        jobs_seen = jobs_.load(std::memory_order_relaxed);
      }
      if (job) job->help();
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

// Blocks 0 .. blocks - 1 of one job, after every block of `first`: shared with the pool's workers, or run here when
// there is one block in all or one thread.
void share(int blocks, const std::function<void(int)>& block, const Phase& first = {}) {
  if (first.blocks + blocks <= 1 || pool().size() == 1) {
    for (int b = 0; b < first.blocks; ++b) (*first.block)(b);
    for (int b = 0; b < blocks; ++b) block(b);
  } else {
    pool().run(first, blocks, block);
  }
}

// out[m, n] *= silu(gate[m, n]) for the columns [begin, end) of M rows of N (gate is overwritten).
void apply_gate(float* gate, float* out, int M, int N, int begin, int end) {
  for (int m = 0; m < M; ++m) {
    float* g = gate + static_cast<int64_t>(m) * N;
    float* o = out + static_cast<int64_t>(m) * N;
    kIsa.silu(g, g, begin, end);
    for (int n = begin; n < end; ++n) o[n] *= g[n];
  }
}

// Output rows per block: about 128 KB of packed weights per 8 input rows (the kernel's row blocks), so that a
// product is split finely enough to balance threads and coarsely enough that claiming a block costs little;
// at least 8 rows (a few KB of weights, reused from L1 by every input row). Blocks of 32 KB / M (a few
// rows each at 8 input rows) made claiming and finishing a block (two contended atomics) a large share of the work.
constexpr int64_t kBlockBytes = 128 * 1024;

// Output rows per block of the product `p` (`gates` 2 for a gated one): at most about kBlockBytes as above, and the
// rows split evenly into a multiple of the pool's threads blocks, so that no thread waits while another finishes a
// block the rest cannot share (SmolLM2's o projection came in blocks of 455 and 121 rows, its gated one in 7).
int block_rows(const Problem& p, int gates) {
  const int64_t row_work = static_cast<int64_t>(p.K) * p.bits / 8 * ((p.M + 7) / 8) * gates;
  const int most = static_cast<int>(std::max<int64_t>(8, kBlockBytes / std::max<int64_t>(1, row_work)));
  const int threads = pool().size(), blocks = ((p.N + most - 1) / most + threads - 1) / threads * threads;
  return std::max(8, (p.N + blocks - 1) / blocks);
}

// x @ W.T, or with `gate`, silu(x @ G.T) * (x @ W.T), by the row loop `rows` (the float or the integer one): each
// block computes the same output rows of both products and combines them, so that the gated product is one pass
// over the pool.
void run(const Problem& p, const Problem* gate, void (*rows_of)(const Problem&, int, int), const Phase& first = {}) {
  const int rows = block_rows(p, gate ? 2 : 1);
  const int blocks = (p.N + rows - 1) / rows;
  auto block = [&](int b) {
    const int begin = b * rows, end = std::min(p.N, (b + 1) * rows);
    rows_of(p, begin, end);
    if (gate == nullptr) return;
    rows_of(*gate, begin, end);
    apply_gate(gate->out, p.out, p.M, p.N, begin, end);
  };
  share(blocks, block, first);
}

// What a CPU op computes: the arrays of one evaluation (its inputs, then its output, allocated) on the CPU
// stream's thread.
using Work = std::function<void(const std::vector<mx::array>& inputs, mx::array& out)>;

// An MLX primitive of one output that runs `work` on the CPU (and refuses the GPU); ops of one `name` and
// `params` are the same op (for mx.compile's merging of repeated work). Its output has its first input's
// shape unless `shape` says otherwise.
class CpuOp : public mx::UnaryPrimitive {
 public:
  CpuOp(const char* name, std::vector<float> params, Work work, std::optional<mx::Shape> shape = std::nullopt)
      : mx::UnaryPrimitive(mx::default_stream(mx::Device::cpu)), name_(name), params_(std::move(params)),
        work_(std::move(work)), shape_(std::move(shape)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> held;
    for (auto& input : inputs) {
      encoder.set_input_array(input);
      held.push_back(mx::array::unsafe_weak_copy(input));
    }
    encoder.set_output_array(out);
    encoder.dispatch([held = std::move(held), out = mx::array::unsafe_weak_copy(out), work = work_]() mutable {
      work(held, out);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }

  const char* name() const override { return name_; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuOp&>(other);
    return std::string(name_) == o.name_ && params_ == o.params_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {shape_.value_or(inputs[0].shape())};
  }

 private:
  const char* name_;
  std::vector<float> params_;
  Work work_;
  std::optional<mx::Shape> shape_;
};

mx::array cpu_op(const char* name, std::vector<float> params, Work work, std::vector<mx::array> inputs,
                 std::optional<mx::Shape> shape = std::nullopt) {
  const mx::Shape out_shape = shape.value_or(inputs[0].shape());
  return mx::array(out_shape, mx::float32, std::make_shared<CpuOp>(name, std::move(params), std::move(work), shape),
                   std::move(inputs));
}

// The elements of `x` in row-major order: its own data when it is contiguous, else a copy in `copy`.
const float* contiguous(const mx::array& x, Floats& copy) {
  if (x.flags().row_contiguous) return x.data<float>();
  copy.resize(x.size());
  gather(x, copy.data());
  return copy.data();
}

// Weight rows per block of a GEMM product: a multiple of every instruction set's tile (12 or 6 rows), and few
// enough that SmolLM2's narrowest product (192 rows) gives two cores two blocks each.
constexpr int kGemmBlockRows = 48;

// Weight rows [begin, end) of a product as contiguous float32 rows of K, written to `scratch` if need be.
using WeightRows = std::function<const float*(int begin, int end, Floats& scratch)>;

// out (M x N) = x @ W.T for float32 x (M x K) and W given block by block by `weights`; with `gate`,
// silu(x @ G.T) * (x @ W.T), both products of a block in one pass over the pool.
void gemm_product(const float* x, int M, int N, int K, float* out, const WeightRows& weights, const WeightRows* gate) {
  const int P = kIsa.panel_rows, panel_count = (M + P - 1) / P;
  thread_local Floats panel_scratch, gate_scratch;  // the calling thread's; the blocks use them through pointers
  panel_scratch.resize(static_cast<size_t>(panel_count) * K * P);
  gate_scratch.resize(gate ? static_cast<size_t>(M) * N : 0);
  float *panels = panel_scratch.data(), *gated = gate_scratch.data();
  share(panel_count, [&](int p) { kIsa.pack(x, M, K, panels, p, p + 1); });
  share((N + kGemmBlockRows - 1) / kGemmBlockRows, [&](int b) {
    thread_local Floats weight_scratch;  // each thread's own
    const int begin = b * kGemmBlockRows, end = std::min(N, begin + kGemmBlockRows);
    kIsa.gemm(Gemm{panels, weights(begin, end, weight_scratch), out + begin, M, N, K}, 0, end - begin);
    if (gate == nullptr) return;
    kIsa.gemm(Gemm{panels, (*gate)(begin, end, weight_scratch), gated + begin, M, N, K}, 0, end - begin);
    apply_gate(gated, out, M, N, begin, end);
  });
}

// Input rows from which a packed product dequantizes each block of weight rows once and runs the GEMM on it,
// instead of the kernel's blocks of 8 input rows: below it the blocks are faster, from it the GEMM
// (benchmarks/native_gemm.py). The GEMM pads its last panel of input rows with zeros, so fewer rows than this past
// the last full panel take the blocks as well (36 rows: a 32-row panel and 4 rows in blocks, not two panels).
constexpr int kDequantizedGemmRows = 28;

// Fewest input rows whose packed products run in float32 where integer products are allowed (not `exact`): below it
// (decode steps, batches of them, speculative verification) the integer products (integer.h) are faster, from it
// the float GEMM (benchmarks/native_matvec.py). It is the GEMM's threshold, so that every row of a product of fewer
// rows computes as it does alone: a batch's sequences get the tokens each gets alone.
constexpr int kIntegerRowsBelow = kDequantizedGemmRows;

// Input rows a block of the GEMM's input preparation (`prepare_inputs`) takes: a multiple of 8.
constexpr int kPreparedRows = 64;

// The product of weight `first` of `in` (its w, scales, biases) for M input rows into dst; the inputs' fields are
// the caller's to fill.
Problem packed_product(const std::vector<mx::array>& in, int first, int M, float* dst, int group_size, int bits) {
  Problem p{};
  p.w = reinterpret_cast<const uint8_t*>(in[first].data<uint32_t>());
  p.scales = in[first + 1].data<uint8_t>();
  p.biases = in[first + 2].data<uint8_t>();
  p.half_scales = in[first + 1].dtype() == mx::float16;
  p.out = dst;
  p.M = M;
  p.N = in[first].shape(0);
  p.K = in[0].shape(-1);
  p.group_size = group_size;
  p.bits = bits;
  return p;
}

// Products of one input, each by the row loop `rows_of`, in one pass over the pool (after the blocks of `first`):
// their blocks (each product's rows split as `run` splits them) are claimed from one counter, so that the narrow ones
// (a block's k and v) do not each wait for the pool.
void run_together(const std::vector<Problem>& products, void (*rows_of)(const Problem&, int, int),
                  const Phase& first) {
  std::vector<int> first_block{0}, rows;
  for (const Problem& p : products) {
    rows.push_back(block_rows(p, 1));
    first_block.push_back(first_block.back() + (p.N + rows.back() - 1) / rows.back());
  }
  share(first_block.back(), [&](int b) {
    const int i = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin()) - 1;
    const Problem& p = products[i];
    const int begin = (b - first_block[i]) * rows[i];
    rows_of(p, begin, std::min(p.N, begin + rows[i]));
  }, first);
}

// The integer products of x = in[0] (quantized once, integer.h, a row a block in the same pass) by the weights whose
// (w, scales, biases) start at each of `firsts` (one layout), into `outs`, in one pass over the pool; with `gate` (the
// first of a gate's weights), the one product's SwiGLU form silu(x @ gate.T) * (x @ w.T). For fewer than
// kIntegerRowsBelow rows of x.
void integer_products(const std::vector<mx::array>& in, const std::vector<int>& firsts, const std::vector<float*>& outs,
                      int gate, int group_size, int bits) {
  const IntegerIsa& isa = kIsa.integer;
  const auto& x = in[0];
  const int K = x.shape(-1), M = static_cast<int>(x.size() / K);
  const int span = bits == 4 ? isa.span4 : isa.span8, stride = quantized_stride(K, span);
  thread_local Floats copy, block_scales, second_scales, sums, gated;
  thread_local std::vector<int8_t, CacheAligned<int8_t>> codes, second_codes;
  thread_local std::vector<uint8_t> parts;
  codes.resize(static_cast<size_t>(M) * stride);
  second_codes.resize(codes.size());
  block_scales.resize(static_cast<size_t>(M) * stride / span * isa.lanes);
  second_scales.resize(block_scales.size());
  parts.resize(static_cast<size_t>(M) * stride / span);
  sums.resize(static_cast<size_t>(M) * (K / group_size));
  const QuantizedInputs quantized{codes.data(),  block_scales.data(), second_codes.data(), second_scales.data(),
                                  parts.data(), sums.data()};
  // each input row quantized in the products' pass over the pool, before any product block
  const float* xs = contiguous(x, copy);
  const int64_t step_lanes = static_cast<int64_t>(stride) / span * isa.lanes, steps = stride / span;
  const std::function<void(int)> quantize_row = [&, xs, quantized](int m) {
    const int64_t row_codes = static_cast<int64_t>(m) * stride;
    const QuantizedInputs row{quantized.xq + row_codes, quantized.xd + m * step_lanes, quantized.xq2 + row_codes,
                              quantized.xd2 + m * step_lanes, quantized.parts + m * steps,
                              quantized.xsum + static_cast<int64_t>(m) * (K / group_size)};
    isa.quantize(xs + static_cast<int64_t>(m) * K, 1, K, group_size, span, isa.lanes, bits == 4, row);
  };
  const Phase first{M, &quantize_row};
  auto problem = [&](int first, float* dst) {
    Problem p = packed_product(in, first, M, dst, group_size, bits);
    p.xq = codes.data();
    p.xd = block_scales.data();
    p.xq2 = second_codes.data();
    p.xd2 = second_scales.data();
    p.parts = parts.data();
    p.xsum = sums.data();
    p.xq_stride = stride;
    return p;
  };
  if (gate >= 0) {
    gated.resize(static_cast<size_t>(M) * in[gate].shape(0));
    const Problem gate_product = problem(gate, gated.data());
    return run(problem(firsts[0], outs[0]), &gate_product, isa.rows, first);
  }
  std::vector<Problem> products;
  for (size_t i = 0; i < firsts.size(); ++i) products.push_back(problem(firsts[i], outs[i]));
  if (products.size() == 1) return run(products[0], nullptr, isa.rows, first);
  run_together(products, isa.rows, first);
}

// Inputs as `product_work`'s, for fewer than kIntegerRowsBelow rows.
void integer_product(const std::vector<mx::array>& in, mx::array& out, int group_size, int bits) {
  integer_products(in, {1}, {out.data<float>()}, in.size() == 7 ? 4 : -1, group_size, bits);
}

// Inputs x, w, scales, biases: x @ dequantize(w).T. Three more (the gate's w, scales, biases): the SwiGLU
// product silu(x @ dequantize(gate).T) * (x @ dequantize(w).T). Unless `exact`, fewer than kIntegerRowsBelow rows
// take the integer products.
Work product_work(int group_size, int bits, bool exact) {
  return [group_size, bits, exact](const std::vector<mx::array>& in, mx::array& out) {
    const auto& x = in[0];
    const int K = x.shape(-1), N = in[1].shape(0), M = static_cast<int>(x.size() / K), groups = K / group_size;
    if (!exact && M < kIntegerRowsBelow) return integer_product(in, out, group_size, bits);
    thread_local Floats copy, prepared, sums, gated;
    const bool gated_product = in.size() == 7;
    const int rest = M % kIsa.panel_rows, gemm_rows = M < kDequantizedGemmRows ? 0
                                                      : rest < kDequantizedGemmRows ? M - rest : M;
    const int rows = M - gemm_rows;  // the blocks' input rows, after the GEMM's
    const float* xs = contiguous(x, copy);
    prepared.resize(x.size());
    sums.resize(static_cast<size_t>(M) * groups);
    // Each part in its own layout; the GEMM's rows (a prompt's hundreds) in blocks of kPreparedRows over the pool,
    // which on one thread took a twentieth of a prefill. The GEMM reads no group sums, and a block of a multiple of 8
    // rows writes none.
    // (the buffers by pointer: `prepared` and `sums` name each thread's own thread_local)
    auto prepare = [&, xs, to = prepared.data(), row_sums = sums.data()](int first_row, int count) {
      prepare_inputs(xs + static_cast<int64_t>(first_row) * K, count, K, group_size, bits,
                     to + static_cast<int64_t>(first_row) * K, row_sums + static_cast<int64_t>(first_row) * groups);
    };
    share((gemm_rows + kPreparedRows - 1) / kPreparedRows, [&](int b) {
      prepare(b * kPreparedRows, std::min(kPreparedRows, gemm_rows - b * kPreparedRows));
    });
    if (rows > 0) prepare(gemm_rows, rows);
    // Input rows [first_row, first_row + count) of the product of weight `first` (w, scales, biases), into dst.
    auto problem = [&](int first, int first_row, int count, float* dst) {
      Problem p = packed_product(in, first, count, dst, group_size, bits);
      p.x = prepared.data() + static_cast<int64_t>(first_row) * K;
      p.xsum = sums.data() + static_cast<int64_t>(first_row) * groups;
      return p;
    };
    if (gemm_rows > 0) {
      auto dequantized = [](const Problem& p) {
        return [&p](int begin, int end, Floats& scratch) {
          scratch.resize(static_cast<size_t>(end - begin) * p.K);
          kIsa.dequantize(p, begin, end, scratch.data());
          return static_cast<const float*>(scratch.data());
        };
      };
      const Problem product = problem(1, 0, gemm_rows, out.data<float>());
      const Problem gate = problem(gated_product ? 4 : 1, 0, gemm_rows, nullptr);
      const WeightRows product_rows = dequantized(product), gate_rows = dequantized(gate);
      gemm_product(prepared.data(), gemm_rows, N, K, out.data<float>(), product_rows,
                   gated_product ? &gate_rows : nullptr);
    }
    if (rows == 0) return;
    float* dst = out.data<float>() + static_cast<int64_t>(gemm_rows) * N;
    if (!gated_product) return run(problem(1, gemm_rows, rows, dst), nullptr, kIsa.rows);
    gated.resize(static_cast<size_t>(rows) * N);
    const Problem gate = problem(4, gemm_rows, rows, gated.data());
    run(problem(1, gemm_rows, rows, dst), &gate, kIsa.rows);
  };
}

// Inputs x, w: x @ w.T in float32. Three (x, gate, up): silu(x @ gate.T) * (x @ up.T).
void float_product_work(const std::vector<mx::array>& in, mx::array& out) {
  const auto& x = in[0];
  const int K = x.shape(-1), N = in[1].shape(0), M = static_cast<int>(x.size() / K);
  thread_local Floats copy, weight_copies[2];
  auto rows_of_weight = [K](const float* w) {
    return [w, K](int begin, int, Floats&) { return w + static_cast<int64_t>(begin) * K; };
  };
  const bool gated = in.size() == 3;
  const WeightRows product = rows_of_weight(contiguous(in[gated ? 2 : 1], weight_copies[0]));
  const WeightRows gate = rows_of_weight(gated ? contiguous(in[1], weight_copies[1]) : nullptr);
  gemm_product(contiguous(x, copy), M, N, K, out.data<float>(), product, gated ? &gate : nullptr);
}

// Queries per block of work: enough that claiming a block costs nothing, few enough that the two cores
// get 24 blocks to share from a 128-token chunk of SmolLM2's 9 heads (3 groups of heads sharing a kv head).
constexpr int kQueryBlock = 16;

// A decode step has one block of queries per batch row and kv head (SmolLM2's 3 left one of 2 threads idle a third of
// the time), so where a row has one block (decode steps, speculative checks of drafts), its keys are split into
// segments of kSegmentKeys (flash decoding: 8 a query at 4,096 keys, 24 work items for SmolLM2's 3 blocks), whose
// sums are combined afterwards, a pass over the output that is small next to reading the keys. A segment is numbered
// among the keys the query sees, and their count depends on the keys alone, so that a query's sums are the same
// alone, in a batch (beside longer rows, left-padded), over a fixed cache's capacity, and in a speculative check;
// the one segment of a query that sees fewer keys is combined to exactly what a single pass gives. Prompt chunks
// have blocks enough.
constexpr int kSegmentKeys = 512;

// The segments that the keys of queries of `queries` a row are split into.
int key_segments(int queries, int keys) {
  return queries > kQueryBlock ? 1 : std::max(1, (keys + kSegmentKeys - 1) / kSegmentKeys);
}

// Output rows per block of work of the combine.
constexpr int64_t kCombineRows = 64;

// Rows [begin, end) of out (`rows` of D floats) from the results of `segments` key segments (`KeySegment`), as
// `partial` holds them: each segment's weighted sums of values (rows x D), then each one's tops, then its totals:
//
//   m = max_s top_s,  out = sum_s e^(top_s - m) sums_s / sum_s e^(top_s - m) total_s
//
// over the segments of which the query sees a key (a total above 0); zeros where it sees none.
void combine_segments(const float* partial, int segments, int64_t rows, int D, float* out, int64_t begin,
                      int64_t end) {
  const float* tops = partial + segments * rows * D;
  const float* totals = tops + segments * rows;
  for (int64_t r = begin; r < end; ++r) {
    float* o = out + r * D;
    std::fill(o, o + D, 0.0f);
    float top = -INFINITY;
    for (int s = 0; s < segments; ++s)
      if (totals[s * rows + r] > 0) top = std::max(top, tops[s * rows + r]);
    if (top == -INFINITY) continue;
    float total = 0.0f;
    for (int s = 0; s < segments; ++s) {
      if (totals[s * rows + r] == 0) continue;
      const float weight = std::exp(tops[s * rows + r] - top);
      const float* sums = partial + (s * rows + r) * D;
      for (int d = 0; d < D; ++d) o[d] += weight * sums[d];
      total += weight * totals[s * rows + r];
    }
    const float inverse = 1.0f / total;  // as a single pass normalises: one segment's result is exactly its
    for (int d = 0; d < D; ++d) o[d] *= inverse;
  }
}

// Blocks of `kQueryBlock` queries of a part of the heads that share a kv head (at most kHeadsTogether, as even as can
// be), for every batch row and kv head, each over one of `key_segments` segments of the keys: `attend(row, first head,
// heads, first query, end query, segment)` runs one. out (batch, heads, queries, head_dim) gets the attention.
template <class Attend>
void share_query_blocks(int batch, int heads, int kv_heads, int queries, int keys, int head_dim, float* out,
                        const Attend& attend) {
  const int group = heads / kv_heads, parts = (group + kHeadsTogether - 1) / kHeadsTogether;
  const int blocks_per_part = (queries + kQueryBlock - 1) / kQueryBlock;
  const int blocks = batch * kv_heads * parts * blocks_per_part, segments = key_segments(queries, keys);
  const int64_t rows = static_cast<int64_t>(batch) * heads * queries;
  thread_local Floats partials;  // the segments' results, laid out as combine_segments reads them
  if (segments > 1) partials.resize(segments * rows * (head_dim + 2));
  float* const partial = partials.data();  // this thread's buffer (a worker's `partials` is its own)
  auto segment_of = [&](int s) {
    if (segments == 1) return KeySegment{0, keys, out, nullptr, nullptr};
    float* const tops = partial + segments * rows * head_dim;
    return KeySegment{s * kSegmentKeys, (s + 1) * kSegmentKeys, partial + s * rows * head_dim, tops + s * rows,
                      tops + (segments + s) * rows};
  };
  share(blocks * segments, [&](int item) {
    const int b = item / segments;
    const int first = b % blocks_per_part * kQueryBlock, part = b / blocks_per_part % parts;
    const int kv_row = b / blocks_per_part / parts, kv_head = kv_row % kv_heads;
    const int head = part * group / parts, end = (part + 1) * group / parts;
    attend(kv_row / kv_heads, kv_head * group + head, end - head, first, std::min(queries, first + kQueryBlock),
           segment_of(item % segments));
  });
  if (segments == 1) return;
  share(static_cast<int>((rows + kCombineRows - 1) / kCombineRows), [&](int b) {
    combine_segments(partial, segments, rows, head_dim, out, b * kCombineRows,
                     std::min(rows, (b + 1) * kCombineRows));
  });
}

// The data of a 4-D array of T and its first three strides, in elements; rows whose last step is not one element
// are first copied into `copy`, contiguous.
template <class T>
const T* rows_of(const mx::array& a, int64_t* strides, std::vector<T, CacheAligned<T>>& copy) {
  const auto& step = a.strides();
  if (step[3] == 1) {
    std::copy(step.begin(), step.begin() + 3, strides);
    return a.data<T>();
  }
  const auto& shape = a.shape();
  copy.resize(a.size());
  gather(a, copy.data());
  strides[2] = shape[3];
  strides[1] = strides[2] * shape[2];
  strides[0] = strides[1] * shape[1];
  return copy.data();
}

// a's keys and values from k and v, float32 or float16 (both of one type).
void set_keys_and_values(Attention& a, const mx::array& k, const mx::array& v) {
  thread_local Floats floats[2];
  thread_local std::vector<Half, CacheAligned<Half>> halves[2];
  a.half_kv = k.dtype() == mx::float16;
  if (a.half_kv) {
    a.k = rows_of(k, a.k_strides, halves[0]);
    a.v = rows_of(v, a.v_strides, halves[1]);
  } else {
    a.k = rows_of(k, a.k_strides, floats[0]);
    a.v = rows_of(v, a.v_strides, floats[1]);
  }
}

// Inputs q, k, v and maybe a boolean mask (batch or 1, 1, queries or 1, keys).
Work attention_work(float scale) {
  return [scale](const std::vector<mx::array>& in, mx::array& out) {
    const auto &q = in[0], &k = in[1], &v = in[2];
    thread_local Floats q_copy;
    Attention a{nullptr, nullptr, nullptr, {}, {}, {}, q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2),
                q.shape(3), scale, nullptr, {}};
    if (in.size() == 4) {
      a.mask = in[3].data<bool>();
      for (int axis : {0, 2, 3}) a.mask_strides[axis == 0 ? 0 : axis - 1] = in[3].shape(axis) == 1 ? 0 : in[3].strides(axis);
    }
    a.q = rows_of(q, a.q_strides, q_copy);
    set_keys_and_values(a, k, v);
    share_query_blocks(a.batch, a.heads, a.kv_heads, a.queries, a.keys, a.head_dim, out.data<float>(),
                       [&](int row, int head, int heads, int begin, int end, const KeySegment& segment) {
                         kIsa.attend(a, row, head, heads, begin, end, segment);
                       });
  };
}

// The data of a 4-D array of T and its first three strides, in units of `unit` (bytes for codes, floats for
// scales); an array whose last axis is not contiguous is first copied into `copy`.
template <class T>
const T* quantized_rows_of(const mx::array& a, int64_t* strides, std::vector<T>& copy, int64_t unit) {
  const auto& step = a.strides();
  if (step[3] == 1) {
    for (int axis = 0; axis < 3; ++axis) strides[axis] = step[axis] * unit;
    return a.data<T>();
  }
  copy.resize(a.size());
  gather(a, copy.data());
  strides[2] = a.shape(3) * unit;
  strides[1] = strides[2] * a.shape(2);
  strides[0] = strides[1] * a.shape(1);
  return copy.data();
}

// Inputs q, then the codes, scales and biases of k and of v, and maybe a boolean mask (batch or 1, 1, queries or 1,
// keys).
Work quantized_attention_work(float scale, int group_size, int bits) {
  return [scale, group_size, bits](const std::vector<mx::array>& in, mx::array& out) {
    const auto& q = in[0];
    thread_local Floats q_copy;
    thread_local std::vector<uint32_t> code_copies[2];
    thread_local std::vector<float> group_copies[4];
    QuantizedAttention a{};
    a.batch = q.shape(0), a.heads = q.shape(1), a.kv_heads = in[1].shape(1), a.queries = q.shape(2);
    a.keys = in[1].shape(2), a.head_dim = q.shape(3), a.group_size = group_size, a.bits = bits, a.scale = scale;
    a.q = rows_of(q, a.q_strides, q_copy);
    QuantizedRows* rows[2] = {&a.k, &a.v};
    for (int r = 0; r < 2; ++r) {
      const int first = 1 + 3 * r;
      rows[r]->codes = reinterpret_cast<const uint8_t*>(
          quantized_rows_of<uint32_t>(in[first], rows[r]->code_strides, code_copies[r], 4));
      rows[r]->scales = quantized_rows_of<float>(in[first + 1], rows[r]->group_strides, group_copies[2 * r], 1);
      int64_t bias_strides[3];
      rows[r]->biases = quantized_rows_of<float>(in[first + 2], bias_strides, group_copies[2 * r + 1], 1);
      if (!std::equal(bias_strides, bias_strides + 3, rows[r]->group_strides))  // one set of strides serves both
        throw std::runtime_error("minimlx_native.quantized_attention: scales and biases must be laid out alike");
    }
    if (in.size() == 8) {
      a.mask = in[7].data<bool>();
      for (int axis : {0, 2, 3}) a.mask_strides[axis == 0 ? 0 : axis - 1] = in[7].shape(axis) == 1 ? 0 : in[7].strides(axis);
    }
    share_query_blocks(a.batch, a.heads, a.kv_heads, a.queries, a.keys, a.head_dim, out.data<float>(),
                       [&](int row, int head, int heads, int begin, int end, const KeySegment& segment) {
                         kIsa.attend_quantized(a, row, head, heads, begin, end, segment);
                       });
  };
}

// Elements per block of work: large enough that claiming one costs nothing next to its exponentials.
constexpr int64_t kSiluBlock = 16 * 1024;

// Inputs x, and for the gated form `up` of x's shape: silu(x), or silu(x) * up.
void silu_work(const std::vector<mx::array>& in, mx::array& out) {
  thread_local Floats copies[2];
  const float* src = contiguous(in[0], copies[0]);
  const float* up = in.size() == 2 ? contiguous(in[1], copies[1]) : nullptr;
  const int64_t n = static_cast<int64_t>(in[0].size());
  const int blocks = static_cast<int>((n + kSiluBlock - 1) / kSiluBlock);
  float* dst = out.data<float>();
  auto block = [&](int b) {
    const int64_t begin = b * kSiluBlock, end = std::min(n, (b + 1) * kSiluBlock);
    kIsa.silu(src, dst, begin, end);
    if (up != nullptr)
      for (int64_t i = begin; i < end; ++i) dst[i] *= up[i];
  };
  share(blocks, block);
}

// x[0]^2 + ... + x[n-1]^2 in 16 running sums (value d in sum d % 16), added in a fixed order: sums the compiler keeps
// in one vector, where one running sum waits on each addition before the next.
float sum_of_squares(const float* x, int n) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[d + l] * x[d + l];
  for (; d < n; ++d) lanes[d % kLanes] += x[d] * x[d];
  float total = 0.0f;
  for (float lane : lanes) total += lane;
  return total;
}

// Rows per block of a norm over the pool: a prompt's hundreds are shared out, a decode step's few stay one block.
constexpr int64_t kNormRows = 64;

// Inputs x (..., dims) and weight (dims,): each row of x over its root mean square, times the weight.
Work rms_norm_work(float eps) {
  return [eps](const std::vector<mx::array>& in, mx::array& out) {
    thread_local Floats copy, weight_copy;
    const float *xs = contiguous(in[0], copy), *weight = contiguous(in[1], weight_copy);  // this thread's copies
    const int dims = in[0].shape(-1);
    const int64_t rows = static_cast<int64_t>(in[0].size()) / dims;
    float* ys = out.data<float>();
    share(static_cast<int>((rows + kNormRows - 1) / kNormRows), [&, xs, weight, ys](int b) {
      for (int64_t r = b * kNormRows; r < std::min(rows, (b + 1) * kNormRows); ++r) {
        const float* x = xs + r * dims;
        float* y = ys + r * dims;
        const float inverse = 1.0f / std::sqrt(sum_of_squares(x, dims) / dims + eps);
        for (int d = 0; d < dims; ++d) y[d] = x[d] * inverse * weight[d];
      }
    });
  };
}

// Inputs x (batch, ..., tokens, head_dim) and cos, sin of the angles: (batch, tokens, dims / 2) (rows at their own
// positions), (tokens, dims / 2) or (dims / 2,) (one position for every token). The first `dims` features of
// every row are rotated in adjacent pairs (`traditional`) or as pairs (i, i + dims / 2); the rest are copied.
Work rotate_work(int dims, bool traditional) {
  return [dims, traditional](const std::vector<mx::array>& in, mx::array& out) {
    thread_local Floats copy, cos_copy, sin_copy;
    const float* x = contiguous(in[0], copy);
    const float *cos_all = contiguous(in[1], cos_copy), *sin_all = contiguous(in[2], sin_copy);
    const int head_dim = in[0].shape(-1), tokens = in[0].shape(-2), half = dims / 2, per_row = in[1].ndim();
    const int64_t rows = static_cast<int64_t>(in[0].size()) / head_dim, rows_per_batch = rows / in[0].shape(0);
    float* y = out.data<float>();
    for (int64_t r = 0; r < rows; ++r, x += head_dim, y += head_dim) {
      const int64_t position = (per_row == 3 ? r / rows_per_batch * tokens : 0) + (per_row >= 2 ? r % tokens : 0);
      const float *cos = cos_all + position * half, *sin = sin_all + position * half;
      for (int i = 0; i < half; ++i) {
        const int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
        y[a] = x[a] * cos[i] - x[b] * sin[i];
        y[b] = x[a] * sin[i] + x[b] * cos[i];
      }
      std::copy(x + dims, x + head_dim, y + dims);
    }
  };
}

mx::array silu(const mx::array& x) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("minimlx_native.silu: x must be float32");
  return cpu_op("MinimlxNativeSilu", {}, silu_work, {x});
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape())
    throw std::invalid_argument("minimlx_native.swiglu: gate and up must be float32 arrays of one shape");
  return cpu_op("MinimlxNativeSwiglu", {}, silu_work, {gate, up});
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 || weight.ndim() != 1 ||
      weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("minimlx_native.rms_norm: x must be float32 (..., dims) and weight float32 (dims,)");
  return cpu_op("MinimlxNativeRmsNorm", {eps}, rms_norm_work(eps), {x, weight});
}

mx::array rotate(const mx::array& x, const mx::array& cos, const mx::array& sin, int dims, bool traditional) {
  const bool angles_fit = x.ndim() >= 2 && (cos.shape() == mx::Shape{dims / 2} ||
                                             cos.shape() == mx::Shape{x.shape(-2), dims / 2} ||
                                             cos.shape() == mx::Shape{x.shape(0), x.shape(-2), dims / 2});
  if (x.dtype() != mx::float32 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || dims <= 0 ||
      dims % 2 || x.ndim() < 2 || dims > x.shape(-1) || sin.shape() != cos.shape() || !angles_fit)
    throw std::invalid_argument(
        "minimlx_native.rotate: x must be float32 (batch, ..., tokens, head_dim), dims even and at most head_dim, "
        "and cos, sin float32 (batch, tokens, dims / 2), (tokens, dims / 2) or (dims / 2,)");
  return cpu_op("MinimlxNativeRotate", {static_cast<float>(dims), traditional ? 1.0f : 0.0f},
                rotate_work(dims, traditional), {x, cos, sin});
}

mx::array causal_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                           const std::optional<mx::array>& mask) {
  const std::string name = mask.has_value() ? "minimlx_native.masked_attention: " : "minimlx_native.causal_attention: ";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + what); };
  if (q.dtype() != mx::float32 || (k.dtype() != mx::float32 && k.dtype() != mx::float16) || v.dtype() != k.dtype())
    fail("q must be float32, and k and v both float32 or both float16");
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape()) fail("q must be 4-D and k, v of one 4-D shape");
  const int head_dim = q.shape(3);
  if (k.shape(0) != q.shape(0) || k.shape(3) != head_dim || k.shape(1) == 0 || q.shape(1) % k.shape(1))
    fail("k and v must have q's batch and head_dim, and a number of heads that divides q's");
  if (head_dim % 16) fail("head_dim must be a multiple of 16, not " + std::to_string(head_dim));
  if (k.shape(2) < q.shape(2)) fail("there must be at least as many keys as queries");
  std::vector<mx::array> inputs{q, k, v};
  if (mask.has_value()) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 4 || m.shape(1) != 1 || m.shape(3) != k.shape(2) ||
        (m.shape(0) != 1 && m.shape(0) != q.shape(0)) || (m.shape(2) != 1 && m.shape(2) != q.shape(2)))
      fail("mask must be boolean, of shape (batch or 1, 1, queries or 1, keys)");
    inputs.push_back(m);
  }
  return cpu_op("MinimlxNativeCausalAttention", {scale}, attention_work(scale), std::move(inputs));
}

mx::array quantized_attention(const mx::array& q, const mx::array& k_codes, const mx::array& k_scales,
                              const mx::array& k_biases, const mx::array& v_codes, const mx::array& v_scales,
                              const mx::array& v_biases, float scale, int group_size, int bits,
                              const std::optional<mx::array>& mask) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("minimlx_native.quantized_attention: " + what); };
  if (q.dtype() != mx::float32 || q.ndim() != 4) fail("q must be float32 (batch, heads, queries, head_dim)");
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8, not " + std::to_string(bits));
  const int head_dim = q.shape(3);
  if (group_size <= 0 || group_size % 32 || head_dim % group_size)
    fail("group_size must be a multiple of 32 that divides head_dim " + std::to_string(head_dim));
  const mx::Shape codes{q.shape(0), k_codes.ndim() == 4 ? k_codes.shape(1) : 0,
                        k_codes.ndim() == 4 ? k_codes.shape(2) : 0, head_dim * bits / 32};
  const mx::Shape groups{codes[0], codes[1], codes[2], head_dim / group_size};
  for (const auto* c : {&k_codes, &v_codes})
    if (c->dtype() != mx::uint32 || c->shape() != codes)
      fail("the codes must be uint32 (batch, kv_heads, keys, head_dim * bits / 32), of q's batch");
  for (const auto* g : {&k_scales, &k_biases, &v_scales, &v_biases})
    if (g->dtype() != mx::float32 || g->shape() != groups)
      fail("the scales and biases must be float32 (batch, kv_heads, keys, head_dim / group_size)");
  if (codes[1] == 0 || q.shape(1) % codes[1]) fail("k and v need a number of heads that divides q's");
  if (codes[2] < q.shape(2)) fail("there must be at least as many keys as queries");
  std::vector<mx::array> inputs{q, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases};
  if (mask.has_value()) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 4 || m.shape(1) != 1 || m.shape(3) != codes[2] ||
        (m.shape(0) != 1 && m.shape(0) != q.shape(0)) || (m.shape(2) != 1 && m.shape(2) != q.shape(2)))
      fail("mask must be boolean, of shape (batch or 1, 1, queries or 1, keys)");
    inputs.push_back(m);
  }
  return cpu_op("MinimlxNativeQuantizedAttention", {scale, static_cast<float>(group_size), static_cast<float>(bits)},
                quantized_attention_work(scale, group_size, bits), std::move(inputs));
}

// x @ w.T (and, with `gate`, silu(x @ gate.T) * (x @ w.T)) for float32 x (..., K) and weights (N, K).
mx::array float_product(const std::string& name, const mx::array& x, const mx::array& w, const mx::array* gate) {
  const bool float32 = x.dtype() == mx::float32 && w.dtype() == mx::float32 && (!gate || gate->dtype() == mx::float32);
  if (!float32 || x.ndim() < 1 || w.ndim() != 2 || (gate && gate->shape() != w.shape()))
    throw std::invalid_argument(name + ": x must be float32 (..., K) and the weights float32 (N, K) of one shape");
  if (w.shape(1) != x.shape(-1) || w.shape(1) == 0)
    throw std::invalid_argument(name + ": x has " + std::to_string(x.shape(-1)) + " features, the weights " +
                                std::to_string(w.shape(1)) + " (they must agree, and be at least one)");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> inputs{x};
  if (gate) inputs.push_back(*gate);
  inputs.push_back(w);
  return cpu_op(gate ? "MinimlxNativeMatmulSwiglu" : "MinimlxNativeMatmul", {}, float_product_work, std::move(inputs),
                shape);
}

// Refuses what the kernel does not read: the message starts with `name`.
// Weights w, scales, biases of a packed product of K input features, as quantized_matmul takes them.
void check_layout(const std::string& name, int K, const mx::array& w, const mx::array& scales, const mx::array& biases,
                  int group_size, int bits) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8, not " + std::to_string(bits));
  if (group_size <= 0 || group_size % 32) fail("group_size must be a multiple of 32, not " + std::to_string(group_size));
  if ((scales.dtype() != mx::float32 && scales.dtype() != mx::float16) || biases.dtype() != scales.dtype())
    fail("scales and biases must be both float32 or both float16");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) fail("w must be a 2-D uint32 array");
  const int N = w.shape(0);
  if (K % group_size || static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(K) * bits)
    fail("w's packed width does not hold x's " + std::to_string(K) + " features at " + std::to_string(bits) + " bits");
  const mx::Shape groups{N, K / group_size};
  if (scales.shape() != groups || biases.shape() != groups) fail("scales and biases must have shape (N, K / group_size)");
}

void check_weights(const std::string& name, const mx::array& x, const mx::array& w, const mx::array& scales,
                   const mx::array& biases, int group_size, int bits) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument(name + ": x must be float32, at least 1-D");
  check_layout(name, x.shape(-1), w, scales, biases, group_size, bits);
}

mx::array product(std::vector<mx::array> inputs, int group_size, int bits, bool exact) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  const std::vector<float> params{static_cast<float>(group_size), static_cast<float>(bits), exact ? 1.0f : 0.0f};
  return cpu_op("MinimlxNativeQuantizedMatmul", params, product_work(group_size, bits, exact), std::move(inputs),
                shape);
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool exact) {
  check_weights("minimlx_native.quantized_matmul", x, w, scales, biases, group_size, bits);
  return product({x, w, scales, biases}, group_size, bits, exact);
}

mx::array quantized_swiglu(const mx::array& x, const mx::array& gate_w, const mx::array& gate_scales,
                           const mx::array& gate_biases, const mx::array& up_w, const mx::array& up_scales,
                           const mx::array& up_biases, int group_size, int bits, bool exact) {
  const std::string name = "minimlx_native.quantized_swiglu";
  check_weights(name, x, gate_w, gate_scales, gate_biases, group_size, bits);
  check_weights(name, x, up_w, up_scales, up_biases, group_size, bits);
  if (gate_w.shape() != up_w.shape()) throw std::invalid_argument(name + ": the gate and up weights must have one shape");
  return product({x, up_w, up_scales, up_biases, gate_w, gate_scales, gate_biases}, group_size, bits, exact);
}

// Products with GGUF's block-quantized weights read as stored (kquant.h): weights w (N, row bytes) uint8 of a type
// (ggml's number), x float32 (..., K).

// The block problem of weight w of `type` for M rows of x into out (the inputs' fields are the caller's to fill).
BlockProblem block_problem(const mx::array& w, int type, int M, int K, float* out) {
  return BlockProblem{w.data<uint8_t>(), w.shape(1), type, {}, out, M, w.shape(0), K};
}

// Weight rows per block of a block product: about kBlockBytes of weights per block, the rows split evenly into a
// multiple of the pool's threads blocks (as `block_rows` above).
int block_product_rows(const BlockProblem& p) {
  const int most = static_cast<int>(std::max<int64_t>(8, kBlockBytes / std::max<int64_t>(1, p.row_bytes)));
  const int threads = pool().size(), blocks = ((p.N + most - 1) / most + threads - 1) / threads * threads;
  return std::max(8, (p.N + blocks - 1) / blocks);
}

// The inputs quantized per block of 32 for the integer products (kquant.h), a row a block of the pool's; where K is a
// multiple of 256 (every K-quant's), with their super-block steps and interleaved codes.
struct QuantizedBlocks {
  std::vector<int8_t, CacheAligned<int8_t>> xq, interleaved;
  Floats xd, steps;
  std::vector<int16_t> sums;
  bool super_blocks = false;
  void quantize(const float* x, int M, int K) {
    xq.resize(static_cast<size_t>(M) * K);
    xd.resize(static_cast<size_t>(M) * (K / 32));
    sums.resize(static_cast<size_t>(M) * (K / 16));
    super_blocks = K % 256 == 0;
    if (super_blocks) {
      interleaved.resize(xq.size());
      steps.resize(sums.size());
    }
    share(M, [&](int m) {
      const int64_t at = static_cast<int64_t>(m) * K;
      quantize_blocks(x + at, K, xq.data() + at, xd.data() + at / 32, sums.data() + at / 16);
      if (!super_blocks) return;
      super_block_steps(xd.data() + at / 32, sums.data() + at / 16, K, steps.data() + at / 16);
      interleave_by_16(xq.data() + at, K, interleaved.data() + at);
    });
  }
  QuantizedBlockInputs inputs() const {
    return {xq.data(), xd.data(), sums.data(), super_blocks ? steps.data() : nullptr,
            super_blocks ? interleaved.data() : nullptr};
  }
};

// The integer products of float32 inputs xs (M x K, quantized once) by each block weight of `products` (their w,
// type, out and sizes set), in one pass over the pool: their blocks of rows claimed from one counter, so that the
// narrow ones (a block's k and v) do not each wait for the pool. Each product gives what `block_product_work` gives.
void integer_block_products(const float* xs, int M, int K, std::vector<BlockProblem>& products) {
  thread_local QuantizedBlocks quantized;
  quantized.quantize(xs, M, K);
  std::vector<int> first_block{0}, rows;
  for (BlockProblem& p : products) {
    p.x = quantized.inputs();
    p.xf = xs;
    rows.push_back(block_product_rows(p));
    first_block.push_back(first_block.back() + (p.N + rows.back() - 1) / rows.back());
  }
  share(first_block.back(), [&](int b) {
    const int i = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin()) - 1;
    const BlockProblem& p = products[i];
    const int begin = (b - first_block[i]) * rows[i];
    kIsa.blocks.rows(p, begin, std::min(p.N, begin + rows[i]));
  });
}

// Fewest input rows of a prompt's product that take the integer GEMM (kquant_gemm_avx512.h) where the instruction set
// has one; fewer (a prompt's last token, fed alone; a short rest after a cached start) take the row products of decode
// steps: the GEMM unpacks every weight block, whose cost a few rows do not repay. Each row of a product of at least
// this many rows sums as it does alone, so a prompt's chunks of at least this many tokens come out the same however
// the prompt is split.
constexpr int kIntegerGemmRows = 8;

// A prompt's product `p` (with `gate_w` of `gate_type`, silu(x @ gate.T) * (x @ up.T), p the up product) by the
// integer GEMM: the inputs quantized once, the weight rows in tiles of kGemmTileRows, one pass over the pool.
void integer_gemm_product(const float* xs, int M, int K, BlockProblem p, const mx::array* gate_w, int gate_type) {
  thread_local QuantizedBlocks quantized;  // the calling thread's: the blocks use them through references
  thread_local GemmInputStore own_inputs, own_gate_inputs;
  thread_local Floats gate_out;
  quantized.quantize(xs, M, K);
  p.x = quantized.inputs();
  const GemmInputs inputs = own_inputs.prepare(p.x, M, K, group_span(p.type));
  GemmInputs gate_inputs = inputs;
  BlockProblem g{};
  if (gate_w != nullptr) {
    gate_out.resize(static_cast<size_t>(M) * p.N);
    g = block_problem(*gate_w, gate_type, M, K, gate_out.data());
    g.x = p.x;
    if (group_span(gate_type) != inputs.span) gate_inputs = own_gate_inputs.prepare(p.x, M, K, group_span(gate_type));
  }
  const int tiles = (p.N + kGemmTileRows - 1) / kGemmTileRows;
  share(tiles, [&](int t) {
    const int begin = t * kGemmTileRows, end = std::min(p.N, begin + kGemmTileRows);
    kIsa.blocks.gemm(p, inputs, begin, end);
    if (gate_w == nullptr) return;
    kIsa.blocks.gemm(g, gate_inputs, begin, end);
    apply_gate(g.out, p.out, M, p.N, begin, end);
  });
}

// Inputs x, w (and with a second weight, x, gate, up: silu(x @ gate.T) * (x @ up.T)), of `types`: the integer
// products, or with `exact` float32 ones: for fewer than kDequantizedGemmRows rows each weight row dequantized once
// and dotted with them, else each block of weight rows dequantized once for the float32 GEMM.
Work block_product_work(std::vector<int> types, bool exact, bool prompt) {
  return [types, exact, prompt](const std::vector<mx::array>& in, mx::array& out) {
    const auto& x = in[0];
    const int K = x.shape(-1), M = static_cast<int>(x.size() / K);
    const bool gated = in.size() == 3;
    thread_local Floats copy, gate_out;
    const float* xs = contiguous(x, copy);
    float* dst = out.data<float>();
    const int product = gated ? 2 : 1, gate = 1;
    if (!exact && prompt && kIsa.blocks.gemm != nullptr && M >= kIntegerGemmRows)
      return integer_gemm_product(xs, M, K, block_problem(in[product], types[product - 1], M, K, dst),
                                  gated ? &in[gate] : nullptr, gated ? types[0] : 0);
    if ((exact || prompt) && M >= kDequantizedGemmRows) {  // a prompt's, without the integer GEMM: the float32 one
      auto dequantized = [K](const mx::array& w, int type) {
        return [p = block_problem(w, type, 0, K, nullptr)](int begin, int end, Floats& scratch) {
          scratch.resize(static_cast<size_t>(end - begin) * p.K);
          kIsa.blocks.dequantize(p, begin, end, scratch.data());
          return static_cast<const float*>(scratch.data());
        };
      };
      const WeightRows weights = dequantized(in[product], types[product - 1]);
      const WeightRows gate_rows = dequantized(in[gate], types[0]);
      return gemm_product(xs, M, in[product].shape(0), K, dst, weights, gated ? &gate_rows : nullptr);
    }
    thread_local QuantizedBlocks quantized;
    if (!exact) quantized.quantize(xs, M, K);
    BlockProblem p = block_problem(in[product], types[product - 1], M, K, dst);
    p.x = quantized.inputs();
    p.xf = xs;
    BlockProblem g{};
    if (gated) {
      gate_out.resize(static_cast<size_t>(M) * p.N);
      g = block_problem(in[gate], types[0], M, K, gate_out.data());
      g.x = p.x;
      g.xf = xs;
    }
    const auto rows_of = exact ? kIsa.blocks.float_rows : kIsa.blocks.rows;
    const int rows = block_product_rows(p);
    share((p.N + rows - 1) / rows, [&](int b) {
      const int begin = b * rows, end = std::min(p.N, begin + rows);
      rows_of(p, begin, end);
      if (!gated) return;
      rows_of(g, begin, end);
      apply_gate(g.out, p.out, M, p.N, begin, end);
    });
  };
}

// Products with stacked experts held as GGUF blocks: row p of out (P x N) is x[p] @ W[ids[p]].T, for w (E, N, row
// bytes) of `type` and ids (P) int32. The pairs are taken in runs of equal consecutive ids (a sorted batch's rows of
// one expert together), each run one product of its rows computed as `block_product_work` computes a product of that
// many rows (integer products, the prompt's integer GEMM from kIntegerGemmRows rows, or float32 rows with `exact`),
// all runs' blocks of weight rows in one pass over the pool. An id outside [0, E) gives a row of zeros.
Work block_gather_work(int type, bool exact, bool prompt) {
  return [type, exact, prompt](const std::vector<mx::array>& in, mx::array& out) {
    const auto& x = in[0];
    const auto& w = in[1];
    const int K = x.shape(-1), P = static_cast<int>(x.size() / K), E = w.shape(0), N = w.shape(1);
    const int64_t row_bytes = w.shape(2), expert_bytes = static_cast<int64_t>(N) * row_bytes;
    thread_local std::vector<int32_t> ids;
    thread_local Floats copy;
    thread_local QuantizedBlocks quantized;
    thread_local GemmInputStore store;
    ids.resize(P);
    gather(in[2], ids.data());
    const float* xs = contiguous(x, copy);
    float* dst = out.data<float>();
    const bool gemm = !exact && prompt && kIsa.blocks.gemm != nullptr;
    QuantizedBlockInputs qx{};
    GemmInputs gx{};
    if (!exact) {
      quantized.quantize(xs, P, K);
      qx = quantized.inputs();
    }
    if (gemm) gx = store.prepare(qx, P, K, group_span(type));
    struct Run {
      BlockProblem product;
      GemmInputs inputs;
      bool gemm;
      int rows;  // weight rows per block of the pool's
    };
    std::vector<Run> runs;
    std::vector<int> first_block{0};
    for (int start = 0, stop; start < P; start = stop) {
      for (stop = start + 1; stop < P && ids[stop] == ids[start];) ++stop;
      const int count = stop - start, expert = ids[start];
      float* rows_out = dst + static_cast<int64_t>(start) * N;
      if (expert < 0 || expert >= E) {
        std::fill(rows_out, rows_out + static_cast<int64_t>(count) * N, 0.0f);
        continue;
      }
      BlockProblem p{w.data<uint8_t>() + expert * expert_bytes, row_bytes, type, {}, rows_out, count, N, K,
                     xs + static_cast<int64_t>(start) * K};
      if (!exact)
        p.x = qx.from_row(start, K);
      const bool run_gemm = gemm && count >= kIntegerGemmRows;
      const int rows = run_gemm ? kGemmTileRows : block_product_rows(p);
      runs.push_back({p, run_gemm ? gx.from_row(start, K) : GemmInputs{}, run_gemm, rows});
      first_block.push_back(first_block.back() + (N + rows - 1) / rows);
    }
    share(first_block.back(), [&](int b) {
      const int i = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin()) - 1;
      const Run& run = runs[i];
      const int begin = (b - first_block[i]) * run.rows, end = std::min(N, begin + run.rows);
      if (run.gemm) kIsa.blocks.gemm(run.product, run.inputs, begin, end);
      else (exact ? kIsa.blocks.float_rows : kIsa.blocks.rows)(run.product, begin, end);
    });
  };
}

// The K input features of weight w of `type`, checked: the message starts with `name`.
int block_features(const std::string& name, const mx::array& w, int type) {
  const int bytes = block_bytes(type);
  if (bytes == 0) throw std::invalid_argument(name + ": type " + std::to_string(type) + " is none of Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
  if (w.dtype() != mx::uint8 || w.ndim() != 2 || w.shape(1) % bytes)
    throw std::invalid_argument(name + ": w must be (N, row bytes) uint8, whole blocks of its type a row");
  return w.shape(1) / bytes * block_values(type);
}

mx::array block_product(const std::string& name, const mx::array& x, std::vector<mx::array> weights,
                        std::vector<int> types, bool exact, bool prompt) {
  if (x.dtype() != mx::float32 || x.ndim() < 1) throw std::invalid_argument(name + ": x must be float32, at least 1-D");
  for (size_t i = 0; i < weights.size(); ++i)
    if (block_features(name, weights[i], types[i]) != x.shape(-1))
      throw std::invalid_argument(name + ": the weights' rows hold a number of features other than x's " +
                                  std::to_string(x.shape(-1)));
  if (weights.size() == 2 && weights[0].shape(0) != weights[1].shape(0))
    throw std::invalid_argument(name + ": the gate and up weights must have as many rows");
  auto shape = x.shape();
  shape.back() = weights[0].shape(0);
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  std::vector<float> params{exact ? 1.0f : 0.0f, prompt ? 1.0f : 0.0f};
  for (int t : types) params.push_back(static_cast<float>(t));
  return cpu_op(weights.size() == 2 ? "MinimlxNativeBlockSwiglu" : "MinimlxNativeBlockMatmul", params,
                block_product_work(types, exact, prompt), std::move(inputs), shape);
}

// x @ W[ids].T per row (block_gather_work), checked.
mx::array block_gather_product(const mx::array& x, const mx::array& w, int type, const mx::array& ids, bool exact,
                               bool prompt) {
  const std::string name = "minimlx_native.block_gather_matmul";
  if (x.dtype() != mx::float32 || x.ndim() != 2) throw std::invalid_argument(name + ": x must be float32 (pairs, K)");
  const int bytes = block_bytes(type);
  if (bytes == 0) throw std::invalid_argument(name + ": type " + std::to_string(type) + " is none of Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
  if (w.dtype() != mx::uint8 || w.ndim() != 3 || w.shape(2) % bytes)
    throw std::invalid_argument(name + ": w must be (experts, N, row bytes) uint8, whole blocks of its type a row");
  if (w.shape(2) / bytes * block_values(type) != x.shape(1))
    throw std::invalid_argument(name + ": the weights' rows hold a number of features other than x's " +
                                std::to_string(x.shape(1)));
  if (ids.dtype() != mx::int32 || ids.ndim() != 1 || ids.shape(0) != x.shape(0))
    throw std::invalid_argument(name + ": ids must be int32, one per row of x");
  std::vector<float> params{exact ? 1.0f : 0.0f, prompt ? 1.0f : 0.0f, static_cast<float>(type)};
  return cpu_op("MinimlxNativeBlockGatherMatmul", params, block_gather_work(type, exact, prompt), {x, w, ids},
                mx::Shape{x.shape(0), w.shape(1)});
}

// Rows `ids` (int32, any shape) of weight w of `type`, dequantized to float32: (*ids.shape, K).
mx::array block_rows_of(const mx::array& w, const mx::array& ids, int type) {
  const std::string name = "minimlx_native.block_rows";
  const int K = block_features(name, w, type);
  if (ids.dtype() != mx::int32) throw std::invalid_argument(name + ": ids must be int32");
  auto shape = ids.shape();
  shape.push_back(K);
  Work work = [type, K](const std::vector<mx::array>& in, mx::array& out) {
    std::vector<int32_t> ids(in[0].size());
    gather(in[0], ids.data());
    const BlockProblem p = block_problem(in[1], type, 0, K, nullptr);
    for (size_t i = 0; i < ids.size(); ++i) {
      const int row = ids[i];
      float* dst = out.data<float>() + static_cast<int64_t>(i) * K;
      if (row < 0 || row >= p.N) std::fill(dst, dst + K, 0.0f);  // as no row: zeros
      else kIsa.blocks.dequantize(p, row, row + 1, dst);
    }
  };
  return cpu_op("MinimlxNativeBlockRows", {static_cast<float>(type)}, work, {ids, w}, shape);
}

// One decode step of a pre-norm block in one op (`block_step`, below), where MLX runs about 20 on the CPU, each
// scheduled onto its CPU stream's thread for several microseconds (docs/performance.md). Each part is computed by the
// work of the op that computes it alone, over the same inputs, so the step gives the same bits as those ops.

// A float32 array of `shape` with a buffer of its own, in no graph: an intermediate result of a fused op.
mx::array scratch(const mx::Shape& shape) {
  mx::array a(shape, mx::float32, nullptr, {});
  a.set_data(mx::allocator::malloc(a.nbytes()));
  return a;
}

// A step's layout (group_size, bits) with group_size kBlockLayout: the weight is held as GGUF blocks of the type
// (ggml's number) in place of bits, as block_matmul takes it; its scales and biases are inside its blocks, and the
// step's inputs repeat the weight in their places.
constexpr int kBlockLayout = 0;

bool held_as_blocks(const int* layout) { return layout[0] == kBlockLayout; }

// The product of the weight whose (w, scales, biases) start at in[first] (with `gate`, the SwiGLU product with the
// gate's at in[gate]) for `input`, into `result`, as quantized_matmul / quantized_swiglu (block_matmul /
// block_swiglu for a block layout) compute it.
void packed(const std::vector<mx::array>& in, int first, const mx::array& input, const mx::array& result,
            const int* layout, bool exact, int gate = -1) {
  mx::array out = result;
  if (held_as_blocks(layout)) {
    if (gate < 0) return block_product_work({layout[1]}, exact, false)({input, in[first]}, out);
    return block_product_work({layout[1], layout[1]}, exact, false)({input, in[gate], in[first]}, out);
  }
  std::vector<mx::array> inputs{input, in[first], in[first + 1], in[first + 2]};
  if (gate >= 0) inputs.insert(inputs.end(), {in[gate], in[gate + 1], in[gate + 2]});
  product_work(layout[0], layout[1], exact)(inputs, out);
}

// The inputs of a step's first part: x (1, 1, dims), the attention norm's weight, the q, k, v projections' (w, scales,
// biases), the cos and sin of the token's angles; it gives q (1, heads, 1, head_dim), k and v (1, kv_heads, 1,
// head_dim), k and v in float32 or in float16 (a float16 cache's type).
enum BlockInputs { kInX, kInNorm, kInQ, kInK = 5, kInV = 8, kInCos = 11, kInSin = 12 };

struct BlockInputsStep {
  float eps;
  int rope_dims, heads;
  bool traditional, exact;
  int layouts[6];  // (group_size, bits) of q, k, v
  bool biased = false;  // q, k and v add biases, in[13], in[14], in[15]
};

// rows (each of b.size() values, contiguous) += b.
void add_bias(mx::array& rows, const mx::array& b) {
  float* r = rows.data<float>();
  const float* bias = b.data<float>();
  const int64_t width = b.size(), count = static_cast<int64_t>(rows.size()) / width;
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < width; ++j) r[i * width + j] += bias[j];
}

// out (float16) = the values of `values` (float32, as many).
void to_half(const mx::array& values, mx::array& out) {
  kIsa.halves(values.data<float>(), out.data<Half>(), static_cast<int64_t>(values.size()));
}

// A step's first part (the attention norm, the q, k, v products, RoPE): q, k and v of `in` (laid out as BlockInputs)
// into out[0], out[1], out[2]; k and v in float16 where those arrays are.
void block_inputs_step(const std::vector<mx::array>& in, std::vector<mx::array> out, const BlockInputsStep& s) {
  const bool half_kv = out[1].dtype() == mx::float16;
  mx::array h = scratch(in[kInX].shape());
  rms_norm_work(s.eps)({in[kInX], in[kInNorm]}, h);
  mx::array q = scratch(out[0].shape()), k = scratch(out[1].shape());
  mx::array v = half_kv ? scratch(out[2].shape()) : out[2];
  const bool one_layout = std::equal(s.layouts, s.layouts + 2, s.layouts + 2) &&
                          std::equal(s.layouts, s.layouts + 2, s.layouts + 4);
  const bool all_blocks = held_as_blocks(s.layouts) && held_as_blocks(s.layouts + 2) && held_as_blocks(s.layouts + 4);
  if (!s.exact && all_blocks) {  // the same, for weights held as blocks (of any types)
    const int M = static_cast<int>(h.size() / h.shape(-1)), K = h.shape(-1);
    std::vector<BlockProblem> products;
    for (auto [first, result, layout] : {std::tuple{kInQ, &q, 0}, std::tuple{kInK, &k, 2}, std::tuple{kInV, &v, 4}})
      products.push_back(block_problem(in[first], s.layouts[layout + 1], M, K, result->data<float>()));
    integer_block_products(h.data<float>(), M, K, products);
  } else if (!s.exact && one_layout) {  // one quantization of h and one pass over the pool for the three
    integer_products({h, in[kInQ], in[kInQ + 1], in[kInQ + 2], in[kInK], in[kInK + 1], in[kInK + 2], in[kInV],
                      in[kInV + 1], in[kInV + 2]},
                     {1, 4, 7}, {q.data<float>(), k.data<float>(), v.data<float>()}, -1, s.layouts[0], s.layouts[1]);
  } else {
    packed(in, kInQ, h, q, s.layouts, s.exact);
    packed(in, kInK, h, k, s.layouts + 2, s.exact);
    packed(in, kInV, h, v, s.layouts + 4, s.exact);
  }
  if (s.biased) {
    add_bias(q, in[13]);
    add_bias(k, in[14]);
    add_bias(v, in[15]);
  }
  const Work rotate = rotate_work(s.rope_dims, s.traditional);
  mx::array rotated_k = half_kv ? scratch(out[1].shape()) : out[1];
  mx::array rotated_q = out[0];
  rotate({q, in[kInCos], in[kInSin]}, rotated_q);
  rotate({k, in[kInCos], in[kInSin]}, rotated_k);
  if (half_kv) {
    to_half(rotated_k, out[1]);
    to_half(v, out[2]);
  }
}

// Attention of one token's q (batch, heads, 1, head_dim) per row over the first `seen` positions of a cache's buffers,
// into out (batch * heads * head_dim): `cache` is keys and values (batch, kv_heads, capacity, head_dim; float32 or
// float16), or their codes, scales and biases as mx.quantize lays them out (`arrays` 6); `mask`, where given, hides
// keys of some rows.
void attend_cache(const mx::array& q, const mx::array* cache, int arrays, int seen, float scale, const mx::array* mask,
                  float* out) {
  const int batch = q.shape(0), heads = q.shape(1), kv_heads = cache[0].shape(1), head_dim = q.shape(3);
  thread_local Floats q_copy;
  auto hide = [&](auto& a) {  // keys a boolean (batch or 1, 1, 1, keys) mask hides: padding of a batch's rows
    if (!mask) return;
    a.mask = mask->data<bool>();
    a.mask_strides[0] = mask->shape(0) == 1 ? 0 : mask->strides(0);
    a.mask_strides[1] = 0;
    a.mask_strides[2] = mask->strides(3);
  };
  auto run = [&](const auto& a, auto attend) {
    share_query_blocks(batch, heads, kv_heads, 1, seen, head_dim, out,
                       [&](int row, int head, int group, int begin, int end, const KeySegment& segment) {
                         attend(a, row, head, group, begin, end, segment);
                       });
  };
  if (arrays == 2) {
    Attention a{nullptr, nullptr, nullptr, {}, {}, {}, batch, heads, kv_heads, 1, seen, head_dim, scale, nullptr, {}};
    a.q = rows_of(q, a.q_strides, q_copy);
    set_keys_and_values(a, cache[0], cache[1]);
    hide(a);
    return run(a, kIsa.attend);
  }
  QuantizedAttention a{};
  hide(a);
  a.batch = batch, a.heads = heads, a.kv_heads = kv_heads, a.queries = 1, a.keys = seen, a.head_dim = head_dim;
  a.group_size = head_dim / cache[1].shape(3), a.bits = cache[0].shape(3) * 32 / head_dim, a.scale = scale;
  a.q = rows_of(q, a.q_strides, q_copy);
  for (auto [rows, first] : {std::pair{&a.k, 0}, std::pair{&a.v, 3}}) {  // row-contiguous buffers (block_step's)
    rows->codes = reinterpret_cast<const uint8_t*>(cache[first].data<uint32_t>());
    rows->scales = cache[first + 1].data<float>();
    rows->biases = cache[first + 2].data<float>();
    for (int axis = 0; axis < 3; ++axis) {
      rows->code_strides[axis] = cache[first].strides(axis) * 4;
      rows->group_strides[axis] = cache[first + 1].strides(axis);
    }
  }
  run(a, kIsa.attend_quantized);
}

// `x` (D floats) as mx.quantize holds a row of `bits`-bit values in groups of `group_size`: the same arithmetic, so
// that a cache written here holds what one written by MLX would.
void quantize_row(const float* x, int D, int group_size, int bits, uint32_t* codes, float* scales, float* biases) {
  const float bins = static_cast<float>((1 << bits) - 1), eps = 1e-7f;
  const int per_word = 32 / bits;
  for (int g = 0; g < D / group_size; ++g) {
    const float* w = x + g * group_size;
    float low = std::numeric_limits<float>::infinity(), high = -low;
    for (int j = 0; j < group_size; ++j) {
      high = std::max(high, w[j]);
      low = std::min(low, w[j]);
    }
    const bool negative = std::abs(low) > std::abs(high);
    float step = std::max((high - low) / bins, eps);
    step = negative ? step : -step;
    const float edge = negative ? low : high, q0 = std::rint(edge / step);
    float bias = 0.0f;
    if (q0 != 0) {
      step = edge / q0;
      bias = edge;
    }
    for (int j = 0; j < group_size / per_word; ++j) {
      uint32_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        const float code = std::min(std::max(std::rint((w[j * per_word + k] - bias) / step), 0.0f), bins);
        word |= static_cast<uint32_t>(code) << (k * bits);
      }
      codes[(g * group_size) / per_word + j] = word;
    }
    scales[g] = step;
    biases[g] = bias;
  }
}

// A step's last part (attention over the cache, the o product, the residual, the feed-forward norm, the SwiGLU products
// and the residual): x (batch, 1, dims) and q (batch, heads, 1, head_dim); the cache's buffers (`arrays` of them,
// the token's keys and values written at `start`), maybe a mask hiding keys of some rows; the o projection's (w,
// scales, biases), the feed-forward norm's weight, the up, gate and down projections' (w, scales, biases), from
// weights[0]. out (batch, 1, dims).
void block_output_step(const mx::array& x, const mx::array& q, const mx::array* cache, int arrays, int start,
                       const mx::array* mask, const mx::array* weights, float scale, float eps, bool exact,
                       const std::vector<int>& layouts, mx::array& out, bool ffn = true) {
  const int batch = x.shape(0), heads = q.shape(1), head_dim = q.shape(3);
  const size_t values = x.size();
  mx::array attended = scratch({batch, 1, heads * head_dim}), o = scratch(x.shape());
  attend_cache(q, cache, arrays, start + 1, scale, mask, attended.data<float>());
  const std::vector<mx::array> in(weights, weights + (ffn ? 13 : 3));  // o at 0, the norm at 3, up at 4, gate at 7, down at 10
  packed(in, 0, attended, o, layouts.data(), exact);
  if (!ffn) {  // the attention's half alone: mid
    const float *xs = x.data<float>(), *os = o.data<float>();
    float* y = out.data<float>();
    for (size_t d = 0; d < values; ++d) y[d] = xs[d] + os[d];
    return;
  }
  mx::array mid = scratch(x.shape()), normed = scratch(x.shape());
  mx::array gated = scratch({batch, 1, in[4].shape(0)}), down = scratch(x.shape());
  const float *xs = x.data<float>(), *os = o.data<float>(), *downs = down.data<float>();
  float *mids = mid.data<float>(), *y = out.data<float>();  // read once: data() in the loops is a call per value
  for (size_t d = 0; d < values; ++d) mids[d] = xs[d] + os[d];
  rms_norm_work(eps)({mid, in[3]}, normed);
  packed(in, 4, normed, gated, layouts.data() + 2, exact, 7);
  packed(in, 10, gated, down, layouts.data() + 4, exact);
  for (size_t d = 0; d < values; ++d) y[d] = mids[d] + downs[d];
}

// Weights w, scales, biases of a packed product of K input features and N outputs, as quantized_matmul takes them.
void check_product(const std::string& name, const std::vector<mx::array>& inputs, int first, int K, int N,
                   const std::vector<int>& layouts, int layout) {
  if (held_as_blocks(layouts.data() + 2 * layout)) {
    if (block_features(name, inputs[first], layouts[2 * layout + 1]) != K || inputs[first].shape(0) != N)
      throw std::invalid_argument(name + ": weight " + std::to_string(first) + " held as blocks must be (" +
                                  std::to_string(N) + ", row bytes) for " + std::to_string(K) + " features");
    return;
  }
  check_layout(name, K, inputs[first], inputs[first + 1], inputs[first + 2], layouts[2 * layout],
               layouts[2 * layout + 1]);
  if (inputs[first].shape(0) != N)
    throw std::invalid_argument(name + ": weight " + std::to_string(first) + " has " +
                                std::to_string(inputs[first].shape(0)) + " outputs, not " + std::to_string(N));
}

void check_token(const std::string& name, const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(0) != 1 || x.shape(1) != 1)
    throw std::invalid_argument(name + ": x must be float32 (1, 1, dims): one token of one sequence");
}

void check_norm(const std::string& name, const mx::array& weight, int dims) {
  if (weight.dtype() != mx::float32 || weight.shape() != mx::Shape{dims})
    throw std::invalid_argument(name + ": the norm's weight must be float32 (dims,)");
}

// `block_step`: a pre-norm block's one-token decode step in one op. The first part (the attention norm, the q, k, v
// products, RoPE), the token's keys and values written into the cache's buffers at `start`, then the last part over
// them. The buffers are keys and values (float32 or float16), or their codes, scales and biases (quantized as
// mx.quantize does, here); they are written in place where MLX lets the op have them (a compiled step's, which
// nothing else holds), else copied first, as MLX's slice_update does. Inputs: x, the buffers (2 or 6), start, the
// 23 weights (the first part's 10, the last part's 13), cos, sin; outputs: the block's output and the buffers.
struct BlockStepSettings {
  BlockInputsStep inputs;
  float scale, eps;
  std::vector<int> layouts;  // (group_size, bits) of the o, up-and-gate and down products
  int arrays;  // the cache's buffers: 2 (float) or 6 (quantized)
  bool masked;  // whether a mask follows sin (and the biases)
  bool ffn = true;  // whether the feed-forward half follows (23 weights), or the step ends at mid (13)
};

// `to` (row-contiguous) = `from`, a 4-D array of the same shape and element size, whatever its strides.
void copy_rows(const mx::array& from, mx::array& to) {
  const size_t item = from.itemsize();
  const char* source = from.data<char>();
  char* target = to.data<char>();
  const auto& shape = from.shape();
  const auto& strides = from.strides();
  for (int a = 0; a < shape[0]; ++a)
    for (int b = 0; b < shape[1]; ++b)
      for (int c = 0; c < shape[2]; ++c) {
        const char* row = source + (a * strides[0] + b * strides[1] + c * strides[2]) * item;
        if (strides[3] == 1) {  // a slice of a wider cache: whole rows
          std::memcpy(target, row, shape[3] * item);
          target += shape[3] * item;
          continue;
        }
        for (int d = 0; d < shape[3]; ++d, target += item) std::memcpy(target, row + d * strides[3] * item, item);
      }
}

// Row `start` of kv head `head` of batch row `b` of a row-contiguous buffer (batch, kv_heads, capacity, width), as bytes.
char* row_at(mx::array& buffer, int b, int head, int start) {
  const size_t row = static_cast<size_t>(buffer.shape(3)) * buffer.itemsize();
  return buffer.data<char>() + ((static_cast<size_t>(b) * buffer.shape(1) + head) * buffer.shape(2) + start) * row;
}

// The cache buffers (by their data) that block_step ops have been scheduled to write and not yet written. A decode
// step is scheduled while the one before it still runs (the engine queues step n + 1, then reads step n's tokens), so
// a layer's buffer is still held then by the previous step's op of that layer (its own copies of its arrays, and
// MLX's, released just after it runs): not donatable, though nothing else holds it, and copied whole (at a long
// context, a seventh of a step). An op scheduled over a buffer that one in this set writes waits for that op first.
class BuffersInFlight {
 public:
  void add(const void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++counts_[data];
  }
  void remove(const void* data) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--counts_[data] == 0) counts_.erase(data);
    }
    done_.notify_all();
  }
  // Whether an op was writing `data`; returns once none is.
  bool wait(const void* data) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!counts_.count(data)) return false;
    done_.wait(lock, [&] { return !counts_.count(data); });
    return true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  std::unordered_map<const void*, int> counts_;
};

BuffersInFlight& buffers_in_flight() {
  static BuffersInFlight* instance = new BuffersInFlight();
  return *instance;
}

// Whether `buffer` may be written in place: donatable, once a previous step's op that writes it has run and MLX has
// let go of its arrays (a task queued just after it: a few microseconds are waited for it; past them the buffer is
// held by something else and is copied).
bool writable_in_place(const mx::array& buffer) {
  if (!buffer.flags().row_contiguous) return false;
  if (buffer.is_donatable() || !buffers_in_flight().wait(buffer.data_shared_ptr().get())) return buffer.is_donatable();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
  while (!buffer.is_donatable() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  return buffer.is_donatable();
}

class BlockStepOp : public mx::Primitive {
 public:
  explicit BlockStepOp(BlockStepSettings settings)
      : mx::Primitive(mx::default_stream(mx::Device::cpu)), settings_(std::move(settings)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int arrays = settings_.arrays;
    // Each output holds its own list of the op's inputs; the others' would keep the buffers from being donated (MLX
    // drops them once the op is evaluated anyway).
    for (auto& output : outputs)
      if (&output.inputs() != &inputs) output.inputs().clear();
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    std::vector<bool> copied(arrays);  // the buffers: the inputs' own where they may be written, else copies
    for (int i = 0; i < arrays; ++i) {
      const mx::array& buffer = inputs[1 + i];
      copied[i] = !writable_in_place(buffer);
      if (copied[i]) outputs[1 + i].set_data(mx::allocator::malloc(outputs[1 + i].nbytes()));
      else outputs[1 + i].copy_shared_buffer(buffer);
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in, out;
    for (auto& input : inputs) {
      encoder.set_input_array(input);
      in.push_back(mx::array::unsafe_weak_copy(input));
    }
    for (auto& output : outputs) {
      encoder.set_output_array(output);
      out.push_back(mx::array::unsafe_weak_copy(output));
    }
    std::vector<const void*> written;  // the buffers this op writes, in flight until it has run
    for (int i = 0; i < arrays; ++i) written.push_back(outputs[1 + i].data_shared_ptr().get());
    for (const void* data : written) buffers_in_flight().add(data);
    encoder.dispatch([in = std::move(in), out = std::move(out), s = settings_, copied, written]() mutable {
      struct Landed {  // the op's own copies of its arrays let go, then its buffers out of flight, however it ends
        std::vector<mx::array>& in;
        std::vector<mx::array>& out;
        const std::vector<const void*>& written;
        ~Landed() {
          in.clear();
          out.clear();
          for (const void* data : written) buffers_in_flight().remove(data);
        }
      } landed{in, out, written};
      const int arrays = s.arrays, weights = 2 + arrays;
      const mx::array& x = in[0];
      for (int i = 0; i < arrays; ++i)
        if (copied[i]) copy_rows(in[1 + i], out[1 + i]);
      const int kv_heads = out[1].shape(1), capacity = out[1].shape(2), start = in[1 + arrays].data<int32_t>()[0];
      if (start < 0 || start >= capacity)
        throw std::runtime_error("minimlx_native.block_step: start " + std::to_string(start) +
                                 " is outside the cache's capacity " + std::to_string(capacity));
      std::vector<mx::array> first{x};
      const int count = s.ffn ? 23 : 13, angles = weights + count;  // cos, sin, then q, k, v's biases
      first.insert(first.end(), in.begin() + weights, in.begin() + weights + 10);
      first.insert(first.end(), {in[angles], in[angles + 1]});
      if (s.inputs.biased) first.insert(first.end(), in.begin() + angles + 2, in.begin() + angles + 5);
      const int batch = x.shape(0), head_dim = in[weights + 1].shape(0) / s.inputs.heads;
      const mx::Dtype kv = arrays == 2 ? out[1].dtype() : mx::float32;
      mx::array q = scratch({batch, s.inputs.heads, 1, head_dim});
      mx::array k(mx::Shape{batch, kv_heads, 1, head_dim}, kv, nullptr, {}), v(k.shape(), kv, nullptr, {});
      k.set_data(mx::allocator::malloc(k.nbytes()));
      v.set_data(mx::allocator::malloc(v.nbytes()));
      block_inputs_step(first, {q, k, v}, s.inputs);
      for (int b = 0; b < batch; ++b)
        for (int h = 0; h < kv_heads; ++h) {
          const int at = b * kv_heads + h;  // the token's row of k and v
          if (arrays == 2) {
            const size_t row = static_cast<size_t>(head_dim) * k.itemsize();
            std::memcpy(row_at(out[1], b, h, start), k.data<char>() + at * row, row);
            std::memcpy(row_at(out[2], b, h, start), v.data<char>() + at * row, row);
            continue;
          }
          const int group_size = head_dim / out[2].shape(3), bits = out[1].shape(3) * 32 / head_dim;
          for (auto [token, first_buffer] : {std::pair{&k, 1}, std::pair{&v, 4}})
            quantize_row(token->data<float>() + at * head_dim, head_dim, group_size, bits,
                         reinterpret_cast<uint32_t*>(row_at(out[first_buffer], b, h, start)),
                         reinterpret_cast<float*>(row_at(out[first_buffer + 1], b, h, start)),
                         reinterpret_cast<float*>(row_at(out[first_buffer + 2], b, h, start)));
        }
      const mx::array* mask = s.masked ? &in[angles + (s.inputs.biased ? 5 : 2)] : nullptr;
      if (mask && mask->shape(3) < start + 1)
        throw std::runtime_error("minimlx_native.block_step: the mask covers fewer keys than the cache holds");
      block_output_step(x, q, out.data() + 1, arrays, start, mask, in.data() + weights + 10, s.scale, s.eps,
                        s.inputs.exact, s.layouts, out[0], s.ffn);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("minimlx_native.block_step runs on the CPU only");
  }

  const char* name() const override { return "MinimlxNativeBlockStep"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const BlockStepOp&>(other).settings_;
    const auto &a = settings_.inputs, &b = o.inputs;
    return a.eps == b.eps && a.rope_dims == b.rope_dims && a.traditional == b.traditional && a.exact == b.exact &&
           a.heads == b.heads && std::equal(a.layouts, a.layouts + 6, b.layouts) && settings_.scale == o.scale &&
           settings_.eps == o.eps && settings_.layouts == o.layouts && settings_.arrays == o.arrays &&
           settings_.masked == o.masked && settings_.ffn == o.ffn && a.biased == b.biased;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes{inputs[0].shape()};
    for (int i = 0; i < settings_.arrays; ++i) shapes.push_back(inputs[1 + i].shape());
    return shapes;
  }

 private:
  BlockStepSettings settings_;
};

std::vector<mx::array> block_step(const mx::array& x, const std::vector<mx::array>& cache, const mx::array& start,
                                  const std::vector<mx::array>& weights, const mx::array& cos, const mx::array& sin,
                                  const std::vector<int>& layouts, int heads, int kv_heads, int rope_dims,
                                  bool traditional, float scale, float attn_eps, float ffn_eps, bool exact,
                                  const std::optional<mx::array>& mask,
                                  const std::optional<std::vector<mx::array>>& biases) {
  const std::string name = "minimlx_native.block_step";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(1) != 1)
    fail("x must be float32 (batch, 1, dims): one token of each sequence");
  const int batch = x.shape(0);
  const bool ffn = weights.size() == 23;
  if (weights.size() != 23 && weights.size() != 13)
    fail("weights must be the attention norm's weight, q's, k's, v's and o's (w, scales, biases), then (for the whole "
         "block) the feed-forward norm's weight, up's, gate's and down's");
  if (layouts.size() != (ffn ? 12 : 8))
    fail("layouts must be the (group_size, bits) of the q, k, v, o (and up-and-gate and down) products");
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || weights[1].ndim() != 2 || weights[1].shape(0) % heads)
    fail("bad head counts");
  const int dims = x.shape(2), head_dim = weights[1].shape(0) / heads, arrays = static_cast<int>(cache.size());
  const mx::Shape buffer{batch, kv_heads, cache.empty() || cache[0].ndim() != 4 ? 0 : cache[0].shape(2), head_dim};
  auto same = [&](int i, mx::Dtype dtype, int width) {
    return cache[i].dtype() == dtype && cache[i].shape() == mx::Shape{buffer[0], buffer[1], buffer[2], width};
  };
  if (arrays == 2) {
    const mx::Dtype kv = cache[0].dtype();
    if ((kv != mx::float32 && kv != mx::float16) || !same(0, kv, head_dim) || !same(1, kv, head_dim))
      fail("keys and values must be float32 or float16, both of one type and shape (batch, kv_heads, capacity, "
           "head_dim)");
  } else if (arrays == 6) {
    const int codes = cache[0].ndim() == 4 ? cache[0].shape(3) : 0, groups = cache[1].ndim() == 4 ? cache[1].shape(3) : 0;
    const int bits = codes * 32 / std::max(1, head_dim), group_size = head_dim / std::max(1, groups);
    if ((bits != 4 && bits != 8) || codes * 32 != bits * head_dim || group_size % 32 || group_size * groups != head_dim)
      fail("quantized keys and values must have 4 or 8 bits in groups of a multiple of 32 dividing head_dim");
    for (int first : {0, 3})
      if (!same(first, mx::uint32, codes) || !same(first + 1, mx::float32, groups) || !same(first + 2, mx::float32, groups))
        fail("the codes (uint32), scales and biases (float32) of the keys and of the values must be (batch, "
             "kv_heads, capacity, ...) as mx.quantize lays them out");
  } else {
    fail("the cache must be its keys and values, or their codes, scales and biases");
  }
  if (start.dtype() != mx::int32 || start.size() != 1) fail("start must be int32, one value");
  if (head_dim % 16) fail("head_dim must be a multiple of 16");
  if (rope_dims <= 0 || rope_dims % 2 || rope_dims > head_dim) fail("rope_dims must be even, at most head_dim");
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), cache.begin(), cache.end());
  inputs.push_back(start);
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  inputs.insert(inputs.end(), {cos, sin});
  const int w = 2 + arrays, width = heads * head_dim;
  check_norm(name, inputs[w], dims);
  check_product(name, inputs, w + 1, dims, width, layouts, 0);
  check_product(name, inputs, w + 4, dims, kv_heads * head_dim, layouts, 1);
  check_product(name, inputs, w + 7, dims, kv_heads * head_dim, layouts, 2);
  check_product(name, inputs, w + 10, width, dims, layouts, 3);
  if (ffn) {
    const int hidden = inputs[w + 14].ndim() == 2 ? inputs[w + 14].shape(0) : 0;
    check_norm(name, inputs[w + 13], dims);
    check_product(name, inputs, w + 14, dims, hidden, layouts, 4);
    check_product(name, inputs, w + 17, dims, hidden, layouts, 4);
    check_product(name, inputs, w + 20, hidden, dims, layouts, 5);
  }
  if (cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || sin.shape() != cos.shape() ||
      (cos.shape() != mx::Shape{rope_dims / 2} && cos.shape() != mx::Shape{batch, 1, rope_dims / 2}))
    fail("cos and sin must be float32, (rope_dims / 2,) or (batch, 1, rope_dims / 2): the angles of every row's "
         "position or of each row's");
  if (biases.has_value()) {
    const std::vector<mx::array>& b = *biases;
    if (b.size() != 3 || b[0].dtype() != mx::float32 || b[0].shape() != mx::Shape{width} || b[1].dtype() != mx::float32 ||
        b[1].shape() != mx::Shape{kv_heads * head_dim} || b[2].dtype() != mx::float32 || b[2].shape() != b[1].shape())
      fail("biases must be q's, k's and v's, float32 of their outputs");
    inputs.insert(inputs.end(), b.begin(), b.end());
  }
  if (mask.has_value()) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ || m.ndim() != 4 || (m.shape(0) != 1 && m.shape(0) != batch) || m.shape(1) != 1 ||
        m.shape(2) != 1 || m.shape(3) > buffer[2])
      fail("mask must be boolean (batch or 1, 1, 1, keys), keys at most the cache's capacity");
    inputs.push_back(m);
  }
  BlockStepSettings settings{{attn_eps, rope_dims, heads, traditional, exact, {}, biases.has_value()}, scale, ffn_eps,
                             std::vector<int>(layouts.begin() + 6, layouts.end()), arrays, mask.has_value(), ffn};
  std::copy(layouts.begin(), layouts.begin() + 6, settings.inputs.layouts);
  std::vector<mx::Shape> shapes{x.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (const auto& a : cache) {
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
  }
  return mx::array::make_arrays(shapes, dtypes, std::make_shared<BlockStepOp>(std::move(settings)), inputs);
}

// What a CPU op of several outputs computes: its inputs, then its outputs (allocated), on the CPU stream's thread.
using MultiWork = std::function<void(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)>;

// An MLX primitive of several outputs that runs `work` on the CPU (and refuses the GPU), as `CpuOp` for one output;
// its outputs have the shapes `shapes` gives for its inputs. Output `donated.second` is written in input
// `donated.first`'s buffer where nothing else holds it (a state replaced by the op's new one), so `work` must read
// each of that input's values before it writes the output's.
class CpuMultiOp : public mx::Primitive {
 public:
  using Shapes = std::function<std::vector<mx::Shape>(const std::vector<mx::array>&)>;
  CpuMultiOp(const char* name, std::vector<float> params, MultiWork work, Shapes shapes,
             std::optional<std::pair<int, int>> donated = std::nullopt)
      : mx::Primitive(mx::default_stream(mx::Device::cpu)), name_(name), params_(std::move(params)),
        work_(std::move(work)), shapes_(std::move(shapes)), donated_(donated) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Each output holds its own list of the op's inputs; the others' would keep the donated input from being
    // donatable (MLX drops them once the op is evaluated anyway).
    for (auto& output : outputs)
      if (&output.inputs() != &inputs) output.inputs().clear();
    for (int j = 0; j < static_cast<int>(outputs.size()); ++j) {
      auto& output = outputs[j];
      if (donated_ && donated_->second == j) {
        const auto& input = inputs[donated_->first];
        if (input.is_donatable() && input.flags().row_contiguous && input.nbytes() == output.nbytes()) {
          output.copy_shared_buffer(input);
          continue;
        }
      }
      output.set_data(mx::allocator::malloc(output.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in, out;
    for (auto& input : inputs) {
      encoder.set_input_array(input);
      in.push_back(mx::array::unsafe_weak_copy(input));
    }
    for (auto& output : outputs) {
      encoder.set_output_array(output);
      out.push_back(mx::array::unsafe_weak_copy(output));
    }
    encoder.dispatch([in = std::move(in), out = std::move(out), work = work_]() mutable { work(in, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name_) + " runs on the CPU only");
  }

  const char* name() const override { return name_; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const CpuMultiOp&>(other);
    return std::string(name_) == o.name_ && params_ == o.params_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return shapes_(inputs); }

 private:
  const char* name_;
  std::vector<float> params_;
  MultiWork work_;
  Shapes shapes_;
  std::optional<std::pair<int, int>> donated_;
};

// The Gated DeltaNet's one-token step after its projections (minimlx/core/recurrent.py's `GatedDeltaNet.mix` is the
// reference), for a batch of rows: the causal convolution over qkv continuing `conv` and silu; q and k l2-normed
// (q over sqrt(key_dims)); decay e^g, g = -e^A_log softplus(a + dt_bias), and beta = sigmoid(b); the delta rule over
// `state` (delta.h); the output of each value head rms-normed, times the norm's weight and silu(z).
// Inputs: qkv (batch, 1, channels), conv (batch, kernel - 1, channels), conv_weight (channels, kernel, 1), a and b
// (batch, 1, value_heads), z (batch, 1, value_heads * value_dims), dt_bias and A_log (value_heads), norm_weight
// (value_dims), state (batch, value_heads, key_dims, value_dims). Outputs: the normed output (z's shape), the new
// conv state and the new recurrent state.
struct DeltaStepSettings {
  int key_heads, key_dims;
  float eps;
};

void delta_step_work(const std::vector<mx::array>& in, std::vector<mx::array>& out, const DeltaStepSettings& s) {
  thread_local Floats copies[10], mixed, qs, ks, decays, betas, heads_out;
  const float* x = contiguous(in[0], copies[0]);
  const float* conv = contiguous(in[1], copies[1]);
  const float* conv_w = contiguous(in[2], copies[2]);
  const float* a = contiguous(in[3], copies[3]);
  const float* b = contiguous(in[4], copies[4]);
  const float* z = contiguous(in[5], copies[5]);
  const float* dt_bias = contiguous(in[6], copies[6]);
  const float* a_log = contiguous(in[7], copies[7]);
  const float* norm_w = contiguous(in[8], copies[8]);
  const float* state = contiguous(in[9], copies[9]);
  const int batch = in[0].shape(0), channels = in[0].shape(2), kept = in[1].shape(1), kernel = kept + 1;
  const int value_heads = in[3].shape(2), Dk = s.key_dims, Dv = in[8].shape(0), Hk = s.key_heads;
  const int key_width = Hk * Dk;
  float* next_conv = out[1].data<float>();
  mixed.resize(static_cast<size_t>(batch) * channels);
  for (int r = 0; r < batch; ++r) {
    const float* window = conv + static_cast<int64_t>(r) * kept * channels;
    const float* token = x + static_cast<int64_t>(r) * channels;
    float* y = mixed.data() + static_cast<int64_t>(r) * channels;
    for (int c = 0; c < channels; ++c) {
      const float* w = conv_w + static_cast<int64_t>(c) * kernel;
      float sum = 0.0f;
      for (int j = 0; j < kept; ++j) sum += window[static_cast<int64_t>(j) * channels + c] * w[j];
      sum += token[c] * w[kept];
      y[c] = sum;
    }
    kIsa.silu(y, y, 0, channels);
    float* kept_out = next_conv + static_cast<int64_t>(r) * kept * channels;
    if (kept > 1) std::memcpy(kept_out, window + channels, sizeof(float) * (kept - 1) * channels);
    if (kept > 0) std::memcpy(kept_out + static_cast<int64_t>(kept - 1) * channels, token, sizeof(float) * channels);
  }
  qs.resize(static_cast<size_t>(batch) * key_width);
  ks.resize(qs.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  for (int r = 0; r < batch; ++r)
    for (int h = 0; h < Hk; ++h) {
      const float* y = mixed.data() + static_cast<int64_t>(r) * channels + h * Dk;
      const int64_t at = (static_cast<int64_t>(r) * Hk + h) * Dk;
      for (auto [from, to, times] : {std::tuple{y, qs.data() + at, scale}, std::tuple{y + key_width, ks.data() + at, 1.0f}}) {
        float squares = 0.0f;
        for (int d = 0; d < Dk; ++d) squares += from[d] * from[d];
        const float inverse = 1.0f / std::sqrt(squares + 1e-6f);
        for (int d = 0; d < Dk; ++d) to[d] = from[d] * inverse * times;
      }
    }
  const int rows = batch * value_heads;
  decays.resize(rows);
  betas.resize(rows);
  for (int at = 0; at < rows; ++at) {
    const int h = at % value_heads;
    const float shifted = a[at] + dt_bias[h];
    const float softplus = std::max(shifted, 0.0f) + std::log1p(std::exp(-std::abs(shifted)));
    decays[at] = std::exp(-std::exp(a_log[h]) * softplus);
    betas[at] = 1.0f / (1.0f + std::exp(-b[at]));
  }
  // v of row r is mixed[r, 2 * key_width:], value heads after one another: as DeltaHeads reads it when batch is 1;
  // a batch's rows are gathered.
  const float* v = mixed.data() + 2 * key_width;
  Floats values;
  if (batch > 1) {
    const int value_width = channels - 2 * key_width;
    values.resize(static_cast<size_t>(batch) * value_width);
    for (int r = 0; r < batch; ++r)
      std::memcpy(values.data() + static_cast<int64_t>(r) * value_width, v + static_cast<int64_t>(r) * channels,
                  sizeof(float) * value_width);
    v = values.data();
  }
  heads_out.resize(static_cast<size_t>(rows) * Dv);
  DeltaHeads d{qs.data(), ks.data(), v, decays.data(), betas.data(), state, out[2].data<float>(), heads_out.data(),
               nullptr, value_heads, Hk, Dk, Dv};
  constexpr int kHeadsPerBlock = 4;
  const float* gates = z;
  float* normed = out[0].data<float>();
  share((rows + kHeadsPerBlock - 1) / kHeadsPerBlock, [&](int block) {
    const int begin = block * kHeadsPerBlock, end = std::min(rows, begin + kHeadsPerBlock);
    thread_local Floats scratch;
    scratch.resize(static_cast<size_t>(kHeadsPerBlock) * Dv);
    DeltaHeads mine = d;
    mine.scratch = scratch.data();
    kIsa.delta_heads(mine, begin, end);
    for (int at = begin; at < end; ++at) {
      const float* o = d.out + static_cast<int64_t>(at) * Dv;  // (thread_local names are this thread's own)
      const float* gate = gates + static_cast<int64_t>(at) * Dv;
      float* y = normed + static_cast<int64_t>(at) * Dv;
      const float inverse = 1.0f / std::sqrt(sum_of_squares(o, Dv) / Dv + s.eps);
      kIsa.silu(gate, y, 0, Dv);
      for (int j = 0; j < Dv; ++j) y[j] *= o[j] * inverse * norm_w[j];
    }
  });
}


// A DeltaNet step's state and parameters, checked for `batch` rows of qkv of `channels`.
void check_delta(const std::string& name, int batch, int channels, const mx::array& conv, const mx::array& conv_weight,
                 const mx::array& dt_bias, const mx::array& A_log, const mx::array& norm_weight, const mx::array& state,
                 int key_heads, int key_dims) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  for (const auto* input : {&conv, &conv_weight, &dt_bias, &A_log, &norm_weight, &state})
    if (input->dtype() != mx::float32) fail("every input must be float32");
  if (state.ndim() != 4 || state.shape(0) != batch || state.shape(2) != key_dims)
    fail("state must be (batch, value_heads, key_dims, value_dims)");
  const int value_heads = state.shape(1), value_dims = state.shape(3);
  if (key_heads <= 0 || key_dims <= 0 || value_heads % key_heads ||
      channels != 2 * key_heads * key_dims + value_heads * value_dims)
    fail("qkv's channels must be 2 * key_heads * key_dims + value_heads * value_dims, value_heads a multiple of "
         "key_heads");
  if (conv_weight.ndim() != 3 || conv_weight.shape(0) != channels || conv_weight.shape(2) != 1)
    fail("conv_weight must be (channels, kernel, 1)");
  if (conv.shape() != mx::Shape{batch, conv_weight.shape(1) - 1, channels})
    fail("conv must be (batch, kernel - 1, channels)");
  if (dt_bias.shape() != mx::Shape{value_heads} || A_log.shape() != dt_bias.shape())
    fail("dt_bias and A_log must be (value_heads,)");
  if (norm_weight.shape() != mx::Shape{value_dims}) fail("norm_weight must be (value_dims,)");
}

std::vector<mx::array> delta_step(const mx::array& qkv, const mx::array& conv, const mx::array& conv_weight,
                                  const mx::array& a, const mx::array& b, const mx::array& z, const mx::array& dt_bias,
                                  const mx::array& A_log, const mx::array& norm_weight, const mx::array& state,
                                  int key_heads, int key_dims, float eps) {
  const std::string name = "minimlx_native.delta_step";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  for (const auto* input : {&qkv, &a, &b, &z})
    if (input->dtype() != mx::float32) fail("every input must be float32");
  if (qkv.ndim() != 3 || qkv.shape(1) != 1) fail("qkv must be (batch, 1, channels): one token of each sequence");
  const int batch = qkv.shape(0);
  check_delta(name, batch, qkv.shape(2), conv, conv_weight, dt_bias, A_log, norm_weight, state, key_heads, key_dims);
  const int value_heads = state.shape(1);
  if (a.shape() != mx::Shape{batch, 1, value_heads} || b.shape() != a.shape())
    fail("a and b must be (batch, 1, value_heads)");
  if (z.shape() != mx::Shape{batch, 1, value_heads * state.shape(3)})
    fail("z must be (batch, 1, value_heads * value_dims)");
  return mx::array::make_arrays({z.shape(), conv.shape(), state.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<CpuMultiOp>(
                                    "MinimlxNativeDeltaStep", std::vector<float>{float(key_heads), float(key_dims), eps},
                                    [s = DeltaStepSettings{key_heads, key_dims, eps}](const auto& in, auto& out) {
                                      delta_step_work(in, out, s);
                                    },
                                    [](const std::vector<mx::array>& in) {
                                      return std::vector<mx::Shape>{in[5].shape(), in[1].shape(), in[9].shape()};
                                    },
                                    std::pair{9, 2}),
                                {qkv, conv, conv_weight, a, b, z, dt_bias, A_log, norm_weight, state});
}

// A pre-norm block around a Gated DeltaNet, one token a row, every projection held as GGUF blocks: n = rms_norm(x)
// (attn_eps); qkv, z, a, b = n's products (one quantization of n, one pass over the pool); the DeltaNet's step
// (`delta_step_work`) and its out projection; mid = x + that; mid + down(silu(gate(m)) * up(m)) for m =
// rms_norm(mid) (ffn_eps). Each product computed as block_matmul / block_swiglu compute it.
// Inputs: x (batch, 1, dims), conv, state, the attention norm's weight, qkv's, z's, a's and b's blocks, conv_weight,
// dt_bias, A_log, the gated norm's weight, out's blocks, the feed-forward norm's weight, gate's, up's and down's blocks.
// Outputs: the block's output (x's shape), the new conv state, the new state.
enum DeltaBlockInputs {
  kDeltaX, kDeltaConv, kDeltaState, kDeltaNorm, kDeltaQkv, kDeltaZ, kDeltaA, kDeltaB, kDeltaConvWeight, kDeltaDtBias,
  kDeltaALog, kDeltaGatedNorm, kDeltaOut, kDeltaFfnNorm, kDeltaGate, kDeltaUp, kDeltaDown, kDeltaInputs
};

struct DeltaBlockSettings {
  DeltaStepSettings step;
  float attn_eps, ffn_eps;
  bool exact;
  std::vector<int> types;  // of qkv, z, a, b, out, gate, up, down
};

// out = x @ W.T for W held as blocks of `type`, as block_matmul computes it (with `gate`, block_swiglu).
void block_product_into(const mx::array& x, const mx::array& w, int type, bool exact, mx::array& out,
                        const mx::array* gate = nullptr) {
  if (gate == nullptr) return block_product_work({type}, exact, false)({x, w}, out);
  block_product_work({type, type}, exact, false)({x, *gate, w}, out);
}

void delta_block_work(const std::vector<mx::array>& in, std::vector<mx::array>& out, const DeltaBlockSettings& s) {
  const mx::array& x = in[kDeltaX];
  const int batch = x.shape(0), dims = x.shape(2), value_heads = in[kDeltaState].shape(1);
  const int value_width = value_heads * in[kDeltaState].shape(3);
  mx::array h = scratch(x.shape());
  rms_norm_work(s.attn_eps)({x, in[kDeltaNorm]}, h);
  mx::array qkv = scratch({batch, 1, in[kDeltaQkv].shape(0)}), z = scratch({batch, 1, value_width});
  mx::array a = scratch({batch, 1, value_heads}), b = scratch({batch, 1, value_heads});
  const std::tuple<int, mx::array*, int> products[] = {{kDeltaQkv, &qkv, 0}, {kDeltaZ, &z, 1}, {kDeltaA, &a, 2},
                                                       {kDeltaB, &b, 3}};
  if (s.exact) {
    for (auto [w, result, type] : products) block_product_into(h, in[w], s.types[type], true, *result);
  } else {
    std::vector<BlockProblem> problems;
    for (auto [w, result, type] : products)
      problems.push_back(block_problem(in[w], s.types[type], batch, dims, result->data<float>()));
    integer_block_products(h.data<float>(), batch, dims, problems);
  }
  mx::array mixed = scratch(z.shape());
  std::vector<mx::array> mix_out{mixed, out[1], out[2]};
  delta_step_work({qkv, in[kDeltaConv], in[kDeltaConvWeight], a, b, z, in[kDeltaDtBias], in[kDeltaALog],
                     in[kDeltaGatedNorm], in[kDeltaState]},
                    mix_out, s.step);
  mx::array o = scratch(x.shape()), mid = scratch(x.shape()), normed = scratch(x.shape());
  block_product_into(mixed, in[kDeltaOut], s.types[4], s.exact, o);
  const size_t values = x.size();
  thread_local Floats x_copy;
  const float *xs = contiguous(x, x_copy), *os = o.data<float>();
  float* mids = mid.data<float>();
  for (size_t d = 0; d < values; ++d) mids[d] = xs[d] + os[d];
  rms_norm_work(s.ffn_eps)({mid, in[kDeltaFfnNorm]}, normed);
  mx::array gated = scratch({batch, 1, in[kDeltaUp].shape(0)}), down = scratch(x.shape());
  block_product_into(normed, in[kDeltaUp], s.types[6], s.exact, gated, &in[kDeltaGate]);
  block_product_into(gated, in[kDeltaDown], s.types[7], s.exact, down);
  const float* downs = down.data<float>();
  float* y = out[0].data<float>();
  for (size_t d = 0; d < values; ++d) y[d] = mids[d] + downs[d];
}


std::vector<mx::array> delta_block_step(const mx::array& x, const mx::array& conv, const mx::array& state,
                                        const std::vector<mx::array>& weights, const std::vector<int>& types,
                                        int key_heads, int key_dims, float eps, float attn_eps, float ffn_eps,
                                        bool exact) {
  const std::string name = "minimlx_native.delta_block_step";
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + ": " + what); };
  if (weights.size() != kDeltaInputs - kDeltaNorm)
    fail("weights must be the attention norm's weight, qkv's, z's, a's and b's blocks, conv_weight, dt_bias, A_log, "
         "the gated norm's weight, out's blocks, the feed-forward norm's weight, gate's, up's and down's blocks");
  if (types.size() != 8) fail("types must be those of qkv, z, a, b, out, gate, up and down");
  if (types[5] != types[6]) fail("gate and up must be blocks of one type");
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(1) != 1)
    fail("x must be float32 (batch, 1, dims): one token of each sequence");
  std::vector<mx::array> inputs{x, conv, state};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  const int dims = x.shape(2), batch = x.shape(0);
  if (state.ndim() != 4) fail("state must be (batch, value_heads, key_dims, value_dims)");
  const int value_width = state.shape(1) * state.shape(3);
  const int qkv_width = 2 * key_heads * key_dims + value_width;
  check_norm(name, inputs[kDeltaNorm], dims);
  check_norm(name, inputs[kDeltaFfnNorm], dims);
  const std::tuple<int, int, int, int> products[] = {
      {kDeltaQkv, 0, dims, qkv_width}, {kDeltaZ, 1, dims, value_width}, {kDeltaA, 2, dims, state.shape(1)},
      {kDeltaB, 3, dims, state.shape(1)}, {kDeltaOut, 4, value_width, dims}, {kDeltaGate, 5, dims, -1},
      {kDeltaUp, 6, dims, -1}, {kDeltaDown, 7, -1, dims}};
  const int hidden = inputs[kDeltaUp].ndim() == 2 ? inputs[kDeltaUp].shape(0) : 0;
  for (auto [at, type, K, N] : products) {
    if (block_features(name, inputs[at], types[type]) != (K < 0 ? hidden : K) || inputs[at].shape(0) != (N < 0 ? hidden : N))
      fail("weight " + std::to_string(at - kDeltaNorm) + " held as blocks must be (outputs, row bytes) for its inputs");
  }
  check_delta(name, batch, qkv_width, conv, inputs[kDeltaConvWeight], inputs[kDeltaDtBias], inputs[kDeltaALog],
              inputs[kDeltaGatedNorm], state, key_heads, key_dims);
  DeltaBlockSettings settings{{key_heads, key_dims, eps}, attn_eps, ffn_eps, exact, types};
  std::vector<float> params{float(key_heads), float(key_dims), eps, attn_eps, ffn_eps, float(exact)};
  for (int t : types) params.push_back(float(t));
  auto work = [settings](const auto& in, auto& out) { delta_block_work(in, out, settings); };
  auto shapes = [](const std::vector<mx::array>& in) {
    return std::vector<mx::Shape>{in[kDeltaX].shape(), in[kDeltaConv].shape(), in[kDeltaState].shape()};
  };
  return mx::array::make_arrays({x.shape(), conv.shape(), state.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<CpuMultiOp>("MinimlxNativeDeltaBlockStep", params, work, shapes,
                                                             std::pair{int(kDeltaState), 2}),
                                inputs);
}
}  // namespace minimlx_native

#include "feedforward_step.h"  // block_moe, block_geglu, block_layer_input: over the block products above

NB_MODULE(_ext, m) {
  m.doc() = "Quantized matrix products for MLX's CPU backend, reading affine-packed weights directly.";
  m.def("quantized_matmul", &minimlx_native::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "exact"_a = false,
        "x @ dequantize(w, scales, biases, group_size, bits).T for float32 x (..., K), w (N, K * bits / 32) "
        "uint32, scales and biases (N, K / group_size) both float32 or both float16 (read as float32); bits 4 or 8, "
        "group_size a multiple of 32. Products of fewer than 28 rows of x quantize x to 8 bits per block of 32 and "
        "use integer dot products, unless `exact` (x stays float32).");
  m.def("quantized_swiglu", &minimlx_native::quantized_swiglu, "x"_a, "gate_w"_a, "gate_scales"_a, "gate_biases"_a,
        "up_w"_a, "up_scales"_a, "up_biases"_a, "group_size"_a, "bits"_a, "exact"_a = false,
        "silu(x @ dequantize(gate).T) * (x @ dequantize(up).T): the gated product of a SwiGLU feed-forward in one "
        "op, for weights of one shape laid out as quantized_matmul's (`exact` as there).");
  m.def("matmul", [](const mx::array& x, const mx::array& w) {
          return minimlx_native::float_product("minimlx_native.matmul", x, w, nullptr);
        }, "x"_a, "w"_a,
        "x @ w.T for float32 x (..., K) and w (N, K): a register-tiled product for many rows of x (a prompt), "
        "on every core.");
  m.def("matmul_swiglu", [](const mx::array& x, const mx::array& gate_w, const mx::array& up_w) {
          return minimlx_native::float_product("minimlx_native.matmul_swiglu", x, up_w, &gate_w);
        }, "x"_a, "gate_w"_a, "up_w"_a,
        "silu(x @ gate_w.T) * (x @ up_w.T) for float32 x (..., K) and weights (N, K) of one shape: a SwiGLU's "
        "gated product in one op.");
  m.def("causal_attention", [](const mx::array& q, const mx::array& k, const mx::array& v, float scale) {
          return minimlx_native::causal_attention(q, k, v, scale, std::nullopt);
        }, "q"_a, "k"_a, "v"_a, "scale"_a,
        "softmax(q k^T * scale) v with a causal mask for float32 q (batch, heads, queries, head_dim) and float32 or float16 k, v "
        "(batch, kv_heads, keys, head_dim), queries being the last of the keys' positions; head_dim a multiple "
        "of 16, heads a multiple of kv_heads.");
  m.def("masked_attention", [](const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                               const mx::array& mask) { return minimlx_native::causal_attention(q, k, v, scale, mask); },
        "q"_a, "k"_a, "v"_a, "scale"_a, "mask"_a,
        "causal_attention that also hides the keys a boolean `mask` (batch or 1, 1, queries or 1, keys) marks "
        "False; a query that sees no key gets zeros.");
  m.def("quantized_attention", &minimlx_native::quantized_attention, "q"_a, "k_codes"_a, "k_scales"_a, "k_biases"_a,
        "v_codes"_a, "v_scales"_a, "v_biases"_a, "scale"_a, "group_size"_a, "bits"_a, "mask"_a = nb::none(),
        "causal_attention (masked_attention with `mask`) over keys and values quantized as mx.quantize gives them: "
        "uint32 codes (batch, kv_heads, keys, head_dim * bits / 32) and float32 scales and biases (batch, kv_heads, "
        "keys, head_dim / group_size); bits 4 or 8, group_size a multiple of 32 dividing head_dim.");
  m.def("silu", &minimlx_native::silu, "x"_a, "x * sigmoid(x) for float32 x, elementwise.");
  m.def("swiglu", &minimlx_native::swiglu, "gate"_a, "up"_a,
        "silu(gate) * up for float32 arrays of one shape, elementwise: a SwiGLU's gate in one pass.");
  m.def("rms_norm", &minimlx_native::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "x / sqrt(mean(x^2) + eps) * weight over the last axis, for float32 x and weight.");
  m.def("rotate", &minimlx_native::rotate, "x"_a, "cos"_a, "sin"_a, "dims"_a, "traditional"_a,
        "Rotary embedding: the first `dims` features of float32 x (batch, ..., tokens, head_dim) rotated by the "
        "angles whose cos and sin are given, (batch, tokens, dims / 2), (tokens, dims / 2) or (dims / 2,) for "
        "every token, in adjacent pairs (traditional) or pairs (i, i + dims / 2).");
  m.def("block_step", &minimlx_native::block_step, "x"_a, "cache"_a, "start"_a, "weights"_a, "cos"_a,
        "sin"_a, "layouts"_a, "heads"_a, "kv_heads"_a, "rope_dims"_a, "traditional"_a, "scale"_a, "attn_eps"_a,
        "ffn_eps"_a, "exact"_a = false, "mask"_a = nb::none(), "biases"_a = nb::none(),
        "A pre-norm block's one-token decode step in one op, for each row of x (batch, 1, dims) float32: h = "
        "rms_norm(x) (attn_eps), q, k, v = its products, RoPE of q and k by cos, sin ((rope_dims / 2,), or (batch, 1, "
        "rope_dims / 2) for a position per row), k and v written into the cache's buffers at position `start` "
        "(int32, one value): `cache` is [keys, values] (batch, kv_heads, capacity, head_dim; float32 or float16) or "
        "the [codes, scales, biases] of the keys and then of the values as mx.quantize gives them (4 or 8 bits, "
        "quantized here as MLX does), attention of q over the buffers' first start + 1 positions (less those a "
        "boolean `mask` (batch or 1, 1, 1, keys) hides: a batch's padding), mid = x + o(attention), and mid + "
        "down(silu(gate(n)) * up(n)) for n = rms_norm(mid) (ffn_eps). `weights`: the attention norm's weight, q's, "
        "k's, v's and o's (w, scales, biases) laid out as quantized_matmul's, the feed-forward norm's weight, up's, "
        "gate's and down's; `layouts` the (group_size, bits) of the q, k, v, o, up-and-gate and down products, or (0, "
        "type) for one held as GGUF blocks (block_matmul's w, given in place of its w, scales and biases alike). "
        "With only the first 13 weights (and 8 layouts) the step ends at mid, the attention's half of a block whose "
        "feed-forward is another op. `biases`: q's, k's and v's biases (float32), added to their products. "
        "Returns [the block's output, *the cache's buffers], written in place where nothing else holds them.");
  m.def("delta_step", &minimlx_native::delta_step, "qkv"_a, "conv"_a, "conv_weight"_a, "a"_a, "b"_a, "z"_a,
        "dt_bias"_a, "A_log"_a, "norm_weight"_a, "state"_a, "key_heads"_a, "key_dims"_a, "eps"_a,
        "A Gated DeltaNet's one-token step after its projections, all float32: the causal convolution of qkv (batch, "
        "1, channels) continuing conv (batch, kernel - 1, channels) with conv_weight (channels, kernel, 1), then silu; "
        "q and k (key_heads of key_dims) l2-normed, q over sqrt(key_dims); decay exp(-exp(A_log) * softplus(a + "
        "dt_bias)) and beta = sigmoid(b) from a, b (batch, 1, value_heads); the gated delta rule over state (batch, "
        "value_heads, key_dims, value_dims), each key head serving value_heads / key_heads consecutive value heads; "
        "each value head's output rms-normed (eps) times norm_weight (value_dims) and silu(z). Returns [that output "
        "(z's shape), the new conv state, the new state].");
  m.def("delta_block_step", &minimlx_native::delta_block_step, "x"_a, "conv"_a, "state"_a, "weights"_a, "types"_a,
        "key_heads"_a, "key_dims"_a, "eps"_a, "attn_eps"_a, "ffn_eps"_a, "exact"_a = false,
        "A pre-norm block around a Gated DeltaNet, one token a row (x float32 (batch, 1, dims)), every projection held "
        "as GGUF blocks (block_matmul's w): n = rms_norm(x) (attn_eps); the DeltaNet's projections of n (qkv, z, a, b) "
        "and its step as delta_step computes it over conv and state; mid = x + out(that); mid + down(silu(gate(m)) * "
        "up(m)) for m = rms_norm(mid) (ffn_eps). `weights`: the attention norm's weight, qkv's, z's, a's and b's "
        "blocks, conv_weight, dt_bias, A_log, the gated norm's weight, out's blocks, the feed-forward norm's weight, "
        "gate's, up's and down's blocks; `types` the blocks' types (qkv, z, a, b, out, gate, up, down). Products take "
        "8-bit inputs for integer dot products unless `exact`. Returns [the block's output, the new conv state, the "
        "new state].");
  m.def("block_matmul", [](const mx::array& x, const mx::array& w, int type, bool exact, bool prompt) {
          return minimlx_native::block_product("minimlx_native.block_matmul", x, {w}, {type}, exact, prompt);
        }, "x"_a, "w"_a, "type"_a, "exact"_a = false, "prompt"_a = false,
        "x @ W.T for float32 x (..., K) and W held as GGUF stores it: w (N, row bytes) uint8, each row K / 256 "
        "super-blocks of Q4_K (type 12), Q5_K (13) or Q6_K (14), or K / 32 blocks of Q8_0 (8). x is quantized to 8 "
        "bits per block of 32 (as llama.cpp's Q8_0) for integer dot products, unless `exact`: x stays float32, each "
        "weight row dequantized once for fewer than 28 rows of x, the float32 GEMM from 28. With `prompt` (a prompt's "
        "product, not `exact`), 8 rows or more take the integer GEMM where the CPU has AVX-512 VNNI (each tile of 32 "
        "weight rows unpacked once for all the rows of x), elsewhere the float32 GEMM from 28 rows.");
  m.def("block_swiglu", [](const mx::array& x, const mx::array& gate_w, int gate_type, const mx::array& up_w,
                           int up_type, bool exact, bool prompt) {
          return minimlx_native::block_product("minimlx_native.block_swiglu", x, {gate_w, up_w}, {gate_type, up_type},
                                               exact, prompt);
        }, "x"_a, "gate_w"_a, "gate_type"_a, "up_w"_a, "up_type"_a, "exact"_a = false, "prompt"_a = false,
        "silu(x @ gate.T) * (x @ up.T) for weights held as block_matmul's, of as many rows: a SwiGLU's gated "
        "product in one op.");
  m.def("block_gather_matmul", &minimlx_native::block_gather_product, "x"_a, "w"_a, "type"_a, "ids"_a,
        "exact"_a = false, "prompt"_a = false,
        "Row p of the result is x[p] @ W[ids[p]].T for stacked experts held as GGUF blocks: x (pairs, K) float32, w "
        "(experts, N, row bytes) uint8 whose rows are block_matmul's, ids (pairs) int32; each run of equal "
        "consecutive ids one product of its rows, as block_matmul computes one (`exact`, `prompt` alike). An id "
        "outside the experts gives zeros.");
  m.def("block_moe", &minimlx_native::block_moe, "x"_a, "router"_a, "score_bias"_a, "experts"_a, "shared"_a,
        "types"_a, "k"_a, "sigmoid"_a, "normalize"_a, "scale"_a, "exact"_a = false,
        "A mixture of experts' step for a few rows of x (..., K) float32, in one op: scores = sigmoid (or softmax) "
        "of router (experts, K) float32 @ x, the k experts of the largest scores + score_bias (float32 (experts,), or "
        "None), weighted by their scores (renormalised to sum 1 with `normalize`) times `scale`; sum over them of "
        "weight * down(silu(gate(x)) * up(x)), for experts = [gate, up, down] held as block_gather_matmul's w, plus "
        "the shared expert's down(silu(gate(x)) * up(x)) for shared = [gate, up, down] held as block_matmul's (or "
        "[]); `types` the ggml types of the six (or three) weights. Each row is quantized once for all its products "
        "(as block_matmul's, unless `exact`).");
  m.def("block_geglu", &minimlx_native::block_geglu, "x"_a, "gate_w"_a, "gate_type"_a, "up_w"_a, "up_type"_a,
        "exact"_a = false,
        "gelu(x @ gate.T) * (x @ up.T) with GELU's tanh form (Gemma's GeGLU) for a few rows of x (..., K) float32 "
        "and weights held as block_matmul's, of as many rows: both products from each row quantized once (unless "
        "`exact`) and the gate, in one op.");
  m.def("geglu", &minimlx_native::geglu, "gate"_a, "up"_a,
        "gelu(gate) * up for float32 arrays of one shape, elementwise, GELU's tanh form: a GeGLU's gate in one pass.");
  m.def("block_layer_input", &minimlx_native::block_layer_input, "h"_a, "gate_w"_a, "gate_type"_a, "proj_w"_a,
        "proj_type"_a, "own"_a, "norm_weight"_a, "eps"_a, "scalar"_a, "exact"_a = false,
        "Gemma 4's per-layer input for a few rows of h (..., D) float32, in one op: (h + rms_norm(proj(gelu(gate(h)) "
        "* own)) * norm_weight) * scalar, gelu the tanh form, gate (I, row bytes) and proj (D, row bytes) held as "
        "block_matmul's, own (..., I) the rows' own inputs, scalar float32 of one value.");
  m.def("block_rows", &minimlx_native::block_rows_of, "w"_a, "ids"_a, "type"_a,
        "Rows `ids` (int32) of a weight held as block_matmul's, dequantized to float32: (*ids.shape, K).");
  m.attr("block_isa") = minimlx_native::kIsa.blocks.name;
  m.attr("isa") = minimlx_native::kIsa.name;
  m.attr("integer_isa") = minimlx_native::kIsa.integer.name;
  m.attr("threads") = minimlx_native::pool().size();
  m.attr("mlx_version") = MINIMLX_NATIVE_MLX_VERSION;
}
