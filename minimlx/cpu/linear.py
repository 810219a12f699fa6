"""Linear maps and embeddings whose products run in the native kernel.

Float32 weights (`NativeLinear`): products of at least `NATIVE_ROWS` input rows (a prompt's chunk, a batch of
sequences) go to the kernel's register-tiled GEMM (native/src/gemm.h), which needs no BLAS thread team to
wake inside MLX; a single row (a decode step) stays on BLAS's matrix-vector product, which streams the
weights once while the GEMM would pad the row to a whole panel.

Packed weights in the kernel's layouts (affine 4- and 8-bit, groups of a multiple of 32, scales and biases in
float32 or float16): the `NativeQuantizedLinear` / `NativeQuantizedEmbedding` forms read the packed words
directly (float16 scales are widened as they are read). Decode steps' products (`core.steps.decode_steps`) of
fewer than 28 input rows multiply 8-bit-quantized inputs by the codes with integer dot products unless
`native.exact_products`; the rest run in float32. Their gate and up projections fuse with the SwiGLU between
them (`gated_product`).

GGUF's Q4_K, Q5_K, Q6_K and Q8_0 matrices, held as the file stores them (`quantization.BLOCK_MODES`), run as
`NativeBlockLinear` / `NativeBlockEmbedding`: decode steps' and the engine's prompts' products (`block_inputs`)
quantize their inputs to 8 bits per block of 32 (as llama.cpp's Q8_0 activations) and multiply them by the stored
codes with integer dot products (a prompt's in an integer GEMM); a model called directly with many rows dequantizes
each block of weight rows once for the float32 GEMM.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..core.moe import ExpertLinear, with_expert_bias
from ..core.steps import decoding, prompting
from ..quantization import BLOCK_MODES
from . import native

NATIVE_ROWS = 2
"""Fewest input rows a float32 product sends to the native GEMM (benchmarks/native_gemm.py measures where BLAS's
matrix-vector product stops being faster)."""


class NativeLinear(nn.Linear):
    """`nn.Linear` whose products of many rows run in the native kernel's float32 GEMM."""

    def runs_native(self, x: mx.array) -> bool:
        return x.dtype == self.weight.dtype == mx.float32 and x.size // max(x.shape[-1], 1) >= NATIVE_ROWS

    def __call__(self, x: mx.array) -> mx.array:
        if not self.runs_native(x):
            return super().__call__(x)
        y = native.kernel.matmul(x, self.weight)
        return y + self.bias if "bias" in self else y


def exact() -> bool:
    """Whether a packed product keeps float32 inputs: unless `native.exact_products`, a decode step's (one token per
    sequence, alone or batched, or a speculative check of drafts) takes the integer products, and a prompt's
    (prefill, however it is chunked or cached) stays float32, so that its first answer token does not depend on how
    much of it was cached."""
    return native.exact_products or not decoding()


class NativeQuantizedLinear(nn.QuantizedLinear):
    """A quantized linear map whose products run in the native kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        y = native.kernel.quantized_matmul(
            x, self.weight, self.scales, self.biases, self.group_size, self.bits, exact=exact()
        )
        return y + self.bias if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose tied-head product (`as_linear`) runs in the native kernel, with float32 inputs:
    the head's product is bound by reading its weight (integer products gain little there), and the logits are
    what greedy decoding compares (docs/performance.md gives how often greedy ids agree with float32 inputs')."""

    def __call__(self, x: mx.array) -> mx.array:
        """The rows of `x` in float32, as the kernel's products are, whatever the scales' type."""
        scales, biases = self.scales[x].astype(mx.float32), self.biases[x].astype(mx.float32)
        return mx.dequantize(self.weight[x], scales, biases, self.group_size, self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return native.kernel.quantized_matmul(
            x, self.weight, self.scales, self.biases, self.group_size, self.bits, exact=True
        )


GEMM_ROWS = 28
"""Fewest input rows of a prompt's product with GGUF blocks that dequantize the weight for the float32 GEMM: fewer (a
short prompt, or the rest of one after a cached prefix) take the integer products, as decode steps do, where
dequantizing the whole weight for a few rows would cost far more than the product (the kernel's quantized_matmul
switches at the same 28 rows)."""


def block_inputs(x: mx.array) -> dict:
    """How a product with GGUF blocks takes its inputs (the native op's `exact` and `prompt`): float32 under
    `--exact`; quantized to 8 bits for integer products in a decode step, and in a prompt fed for generation (the
    integer GEMM, where the CPU has one); otherwise float32 from GEMM_ROWS rows (a model called directly: the anatomy
    tools, comparisons with a file's dequantized weights) and integer products below."""
    if native.exact_products:
        return {"exact": True}
    if decoding():
        return {"exact": False}
    if prompting():
        return {"exact": False, "prompt": True}
    return {"exact": x.size // max(x.shape[-1], 1) >= GEMM_ROWS}


class BlockWeight(nn.Module):
    """A weight held as GGUF blocks: `weight` (rows, row bytes) uint8, of block mode `mode` (`BLOCK_MODES`)."""

    def __init__(self, rows: int, in_dims: int, mode: str):
        super().__init__()
        ggml_type, values, size, _ = BLOCK_MODES[mode]
        self.mode, self.ggml_type, self.in_dims = mode, ggml_type, in_dims
        self.weight = mx.zeros((rows, in_dims // values * size), mx.uint8)

    def _extra_repr(self) -> str:
        return f"rows={self.weight.shape[0]}, in_dims={self.in_dims}, mode={self.mode}"


class NativeBlockLinear(BlockWeight):
    """A linear map whose weight is held as GGUF blocks, its products in the native kernel (`block_matmul`)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, bits: int, mode: str) -> "NativeBlockLinear":
        rows, in_dims = linear.weight.shape
        module = cls(rows, in_dims, mode)
        if "bias" in linear:
            module.bias = linear.bias
        return module

    def __call__(self, x: mx.array) -> mx.array:
        y = native.kernel.block_matmul(x, self.weight, self.ggml_type, **block_inputs(x))
        return y + self.bias if "bias" in self else y


class NativeBlockEmbedding(BlockWeight):
    """An embedding whose table is held as GGUF blocks: rows dequantized as they are looked up (`block_rows`), and its
    tied-head product (`as_linear`) in the native kernel as `NativeBlockLinear`'s: a decode step's with integer
    products (with float32 inputs, dequantizing each table row for one step's row takes several times as long)."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group_size: int, bits: int, mode: str) -> "NativeBlockEmbedding":
        return cls(*embedding.weight.shape, mode)

    def __call__(self, x: mx.array) -> mx.array:
        return native.kernel.block_rows(self.weight, x.astype(mx.int32), self.ggml_type)

    def as_linear(self, x: mx.array) -> mx.array:
        return native.kernel.block_matmul(x, self.weight, self.ggml_type, **block_inputs(x))


class NativeBlockExperts(nn.Module):
    """`ExpertLinear` whose stacked weight is held as GGUF blocks, `weight` (experts, out, row bytes) uint8: each row's
    product with its expert's weight in the native kernel (`block_gather_matmul`), the inputs taken as
    `NativeBlockLinear`'s are."""

    def __init__(self, num_experts: int, rows: int, in_dims: int, mode: str):
        super().__init__()
        ggml_type, values, size, _ = BLOCK_MODES[mode]
        self.mode, self.ggml_type, self.in_dims = mode, ggml_type, in_dims
        self.weight = mx.zeros((num_experts, rows, in_dims // values * size), mx.uint8)

    @classmethod
    def from_experts(cls, experts: ExpertLinear, group_size: int, bits: int, mode: str) -> "NativeBlockExperts":
        module = cls(*experts.weight.shape, mode)
        if "bias" in experts:
            module.bias = experts.bias
        return module

    def __call__(self, x: mx.array, expert_indices: mx.array, sorted_indices: bool) -> mx.array:
        """As `ExpertLinear`: x (..., 1, in) against expert_indices (...), broadcast, -> (..., 1, out)."""
        batch = mx.broadcast_shapes(x.shape[:-2], expert_indices.shape)
        rows = mx.broadcast_to(x, (*batch, *x.shape[-2:])).reshape(-1, x.shape[-1])
        ids = mx.broadcast_to(expert_indices, batch).reshape(-1).astype(mx.int32)
        y = native.kernel.block_gather_matmul(rows, self.weight, self.ggml_type, ids, **block_inputs(rows))
        return with_expert_bias(self, y.reshape(*batch, 1, -1), expert_indices)

    def _extra_repr(self) -> str:
        experts, rows, _ = self.weight.shape
        return f"experts={experts}, rows={rows}, in_dims={self.in_dims}, mode={self.mode}"


DEQUANTIZED_BYTES = 1 << 20
"""About how many bytes of float32 weight rows `through_dequantized` makes at a time."""


def through_dequantized(x: mx.array, dequantize, *packed: mx.array) -> mx.array:
    """`x @ W.T` for a frozen packed weight W = dequantize(*packed), made a tile of rows at a time, each tile only
    once the previous tile's product is done, and made again in the backward pass rather than kept from the forward
    one: training's products with a packed base hold about DEQUANTIZED_BYTES of float weight each, never a layer's
    or the model's, and run as MLX's float GEMM (its CPU products read packed codes many times slower). No gradient
    flows into the packed arrays. `dequantize` takes row slices of `packed`."""
    rows = packed[0].shape[0]
    step = max(16, DEQUANTIZED_BYTES // (4 * x.shape[-1]))
    tiles = [(start, min(start + step, rows)) for start in range(0, rows, step)]

    def tile(parts, start, stop, after):
        parts = [p[start:stop] for p in parts]
        return dequantize(*(parts if after is None else mx.depends(parts, [after])))

    @mx.custom_function
    def product(x, *packed):
        pieces = []
        for start, stop in tiles:
            pieces.append(x @ tile(packed, start, stop, pieces[-1] if pieces else None).T.astype(x.dtype))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, *packed = primals
        d_x = None
        for start, stop in tiles:
            d_x_tile = cotangent[..., start:stop] @ tile(packed, start, stop, d_x).astype(cotangent.dtype)
            d_x = d_x_tile if d_x is None else d_x + d_x_tile
        return (d_x, *(mx.zeros_like(p) for p in packed))

    return product(x, *packed)


class QuantizedLinearByOps(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose products dequantize the packed weight as they are computed (training on the CPU)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = through_dequantized(x, affine_dequantizer(self), *affine_parts(self))
        return y + self.bias if "bias" in self else y


class QuantizedEmbeddingByOps(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose tied-head product dequantizes the table as it is computed (training)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return through_dequantized(x, affine_dequantizer(self), *affine_parts(self))


def affine_parts(module: nn.Module) -> tuple[mx.array, ...]:
    return (module.weight, module.scales) + ((module.biases,) if "biases" in module else ())


def affine_dequantizer(module: nn.Module):
    def dequantize(weight, scales, biases=None):
        return mx.dequantize(weight, scales, biases, module.group_size, module.bits, mode=module.mode)

    return dequantize


class BlockLinearByOps(NativeBlockLinear):
    """`NativeBlockLinear` as MLX ops that have gradients (training): the frozen weight dequantized as the product is
    computed (`through_dequantized`: no gradient flows into the stored blocks), then `x @ W.T`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = through_dequantized(x, block_dequantizer(self), self.weight)
        return y + self.bias if "bias" in self else y


class BlockEmbeddingByOps(NativeBlockEmbedding):
    """`NativeBlockEmbedding` whose tied-head product is MLX's matmul over the dequantized table (training)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return through_dequantized(x, block_dequantizer(self), self.weight)


class BlockExpertsByOps(NativeBlockExperts):
    """`NativeBlockExperts` as MLX ops that have gradients (training): the stacked weight dequantized (no gradient flows
    into the stored blocks), then MLX's gathered matmul, as `ExpertLinear` computes it."""

    def __call__(self, x: mx.array, expert_indices: mx.array, sorted_indices: bool) -> mx.array:
        experts, rows, _ = self.weight.shape
        stacked = self.weight.reshape(experts * rows, -1)
        weight = native.kernel.block_rows(stacked, mx.arange(experts * rows, dtype=mx.int32), self.ggml_type)
        weight = mx.stop_gradient(weight.reshape(experts, rows, -1))
        y = mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=expert_indices, sorted_indices=sorted_indices)
        return with_expert_bias(self, y, expert_indices)


def block_dequantizer(module: BlockWeight):
    def dequantize(weight):
        rows = mx.arange(weight.shape[0], dtype=mx.int32)
        return native.kernel.block_rows(weight, rows, module.ggml_type)

    return dequantize


BLOCK_FORMS = {
    nn.Linear: NativeBlockLinear.from_linear,
    nn.Embedding: NativeBlockEmbedding.from_embedding,
    ExpertLinear: NativeBlockExperts.from_experts,
}
"""The native kernel's form of each module type it runs from weights held as GGUF blocks."""


STORED_MODES = ("q4_k", "q5_k", "q6_k")
"""The block modes loading keeps as stored where the kernel is installed. Q8_0 stays in MLX's affine 8-bit groups
(exactly its values, 9 bits a weight for 8.5), whose products with float32 inputs (a tied head's, as SmolLM2's Q8_0
embedding is) read the codes directly at 7x the speed of dequantizing Q8_0 rows first."""


def stored_block_types() -> frozenset[int]:
    """The GGUF types (ggml's numbers) the native kernel multiplies as stored; none without it."""
    return frozenset(BLOCK_MODES[m][0] for m in STORED_MODES) if native.kernel is not None else frozenset()


QUANTIZED_FORMS = {
    nn.Linear: NativeQuantizedLinear.from_linear,
    nn.Embedding: NativeQuantizedEmbedding.from_embedding,
}
"""The native kernel's quantized form of each module type it can run packed."""


def runs_packed(module: nn.Module, group_size: int, bits: int, mode: str) -> bool:
    """Whether the native kernel computes `module`'s products from its packed weight: linear maps and embeddings
    (whose `as_linear` is a tied head) in affine 4- or 8-bit with groups of a multiple of 32, whether their scales
    and biases are held in float32 or float16."""
    if mode in BLOCK_MODES:
        return type(module) in BLOCK_FORMS
    return type(module) in QUANTIZED_FORMS and mode == "affine" and bits in (4, 8) and group_size % 32 == 0


def gated_product(x: mx.array, gate: nn.Module, up: nn.Module) -> mx.array | None:
    """silu(gate(x)) * up(x) in one native op when both maps are bias-free native forms of one layout (the two
    products share one pass over the kernel's threads, the silu and product happen on the way); else None."""
    if type(gate) is not type(up) or "bias" in gate or "bias" in up:
        return None
    if type(gate) is NativeBlockLinear:
        if gate.weight.shape[0] != up.weight.shape[0]:
            return None
        return native.kernel.block_swiglu(x, gate.weight, gate.ggml_type, up.weight, up.ggml_type, **block_inputs(x))
    if type(gate) is NativeQuantizedLinear:
        if (gate.group_size, gate.bits, gate.weight.shape) != (up.group_size, up.bits, up.weight.shape):
            return None
        return native.kernel.quantized_swiglu(
            *(x, gate.weight, gate.scales, gate.biases, up.weight, up.scales, up.biases, gate.group_size, gate.bits),
            exact=exact(),
        )
    if type(gate) is NativeLinear and gate.runs_native(x) and gate.weight.shape == up.weight.shape:
        return native.kernel.matmul_swiglu(x, gate.weight, up.weight) if up.weight.dtype == mx.float32 else None
    return None


GEGLU_ROWS = 8
"""Fewer input rows than this take `block_geglu` (a decode step's; a prompt's products of more rows take the integer
GEMM, as block_matmul's do from 8)."""


def gelu_gated_product(x: mx.array, gate: nn.Module, up: nn.Module) -> mx.array | None:
    """gelu_approx(gate(x)) * up(x) in one native op (`block_geglu`) for a few rows of x when both maps are bias-free
    GGUF blocks of as many rows: both products from x quantized once, the gate on the way; else None."""
    if type(gate) is not NativeBlockLinear or type(up) is not NativeBlockLinear or "bias" in gate or "bias" in up:
        return None
    if gate.weight.shape[0] != up.weight.shape[0] or x.size // x.shape[-1] >= GEGLU_ROWS:
        return None
    exact = block_inputs(x)["exact"]
    return native.kernel.block_geglu(x, gate.weight, gate.ggml_type, up.weight, up.ggml_type, exact=exact)


def packed_on_kernel(model: nn.Module, spec: dict[str, dict]) -> dict[str, dict]:
    """The part of `spec` (module path -> its packed layout) whose products the native kernel computes from the
    packed weights; none without the kernel."""
    if native.kernel is None:
        return {}
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    return {path: q for path, q in spec.items() if path in modules and runs_packed(modules[path], **q)}


def quantize_on_kernel(model: nn.Module, spec: dict[str, dict]) -> None:
    """Swap the modules `spec` names (chosen by `packed_on_kernel`) for their native quantized forms."""

    def swap(path: str, module: nn.Module) -> nn.Module:
        if path not in spec:
            return module
        forms = BLOCK_FORMS if spec[path]["mode"] in BLOCK_MODES else QUANTIZED_FORMS
        return forms[type(module)](module, **spec[path])

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
