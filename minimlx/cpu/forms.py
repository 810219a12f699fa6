"""The CPU forms of core parts, and the swap that puts them into a model that runs on the CPU.

Each form is its core part with one method computed differently where MLX's CPU backend composes many small
ops (or scalar ones) for what the native kernel, or a spelled-out formula, does in fewer: the parameters,
children and results are the core part's. Loading swaps a module's class for its form (`use_cpu_forms`), as
it swaps `Linear` for a quantized form where the file holds packed weights; reading core never requires
knowing which device runs it.
"""

import mlx.core as mx
import mlx.nn as nn

from ..core import Attention, Block, GatedFFN, OffsetRMSNorm, RMSNorm, RoPE, SharedKVAttention, SwiGLU, Transformer
from ..core.cache import Can
from ..core.positions import Positions
from ..core.recorder import Recorder
from . import attention, elementwise, native
from .linear import (
    BlockEmbeddingByOps,
    BlockExpertsByOps,
    BlockLinearByOps,
    NativeBlockEmbedding,
    NativeBlockExperts,
    NativeBlockLinear,
    NativeLinear,
    NativeQuantizedEmbedding,
    NativeQuantizedLinear,
    QuantizedEmbeddingByOps,
    QuantizedLinearByOps,
    block_inputs,
    exact,
    gated_product,
)


class CpuTransformer(Transformer):
    """The one loop, with each layer of a one-token step queued as soon as it is built.

    MLX's CPU `async_eval` computes all but the last ~100 ops of what it is given before it returns, so a step
    queued whole leaves the CPU idle while Python builds the graph, and Python idle while it is computed; queued
    per layer, layer i computes while layer i + 1 is built. Only over growing caches (the engine's eager decode):
    a compiled step is one replayed graph, and a recorder wants the whole pass.
    """

    def run_layer(self, layer: nn.Module, x: mx.array, cache, recorder, positions: Positions):
        x = layer(x, cache, recorder, positions)
        if positions.tokens == 1 and recorder is None and cache is not None and not cache.can(Can.FIXED):
            mx.async_eval(x)
        return x


class CpuAttention(Attention):
    """Attention through `cpu.attention.attend` (the native kernel's ops, or blocked causal attention), over keys and
    values cached in float16 where the kernel reads them (`halves_cache`)."""

    def cached(self, k, v, cache):
        if halves_cache(self, k, cache):
            return k.astype(mx.float16), v.astype(mx.float16)
        return k, v

    def attend(self, q, k, v, mask, sinks):
        return attention.attend(q, k, v, self.scale, mask, sinks)

    def attend_quantized(self, q, k, v, mask, group_size, bits):
        return attention.attend_quantized(q, k, v, self.scale, mask, group_size, bits)


class CpuSharedKVAttention(SharedKVAttention, CpuAttention):
    """Attention over another layer's keys and values through `cpu.attention.attend`, as that layer's own (whose
    cache may hold them in float16)."""


def halves_cache(attn: Attention, k: mx.array, cache) -> bool:
    """Whether `attn` caches its float32 keys and values in float16: where the native kernel's attention reads them
    (no sinks, no capped scores, heads of a multiple of 16 features, a plain or windowed cache), its projections are
    packed (4- or 8-bit weights or GGUF blocks, whose own rounding is far coarser than float16's 2^-11), and `--exact`
    did not ask for float32 throughout. Decode steps after long prompts read the cache more than the weights: half the
    bytes."""
    if native.kernel is None or native.exact_products or k.dtype != mx.float32 or quantized(cache):
        return False
    if "sinks" in attn or attn.logit_cap is not None or attn.head_dim % 16:
        return False
    packed = (NativeQuantizedLinear, NativeBlockLinear)
    return type(attn.k_proj) in packed and (attn.values_from_keys or type(attn.v_proj) in packed)


class CpuRoPE(RoPE):
    """RoPE spelled out from the pass's shared angles: MLX's CPU `fast.rope` is itself composed of ops and builds
    its angles from an `arange` on every call, for every layer. The native kernel rotates in one op."""

    def rotate(self, x: mx.array, positions: Positions) -> mx.array:
        if x.dtype != mx.float32:
            return super().rotate(x, positions)
        cos, sin = positions.angles(self)
        if native.kernel is not None:
            rotated = native.kernel.rotate(x, cos, sin, self.dims, self.traditional)
        else:
            rotated = self.rotate_by(x, cos, sin)
        return rotated * self.output_scale if self.output_scale != 1.0 else rotated

    def rotate_by(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        if cos.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]  # the same for every head
        half = self.dims // 2
        if self.traditional:  # rotated pairs are adjacent features
            pairs = x[..., : self.dims].reshape(*x.shape[:-1], half, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            rotated = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(*x.shape[:-1], self.dims)
        else:  # pairs are feature i and i + dims / 2
            x1, x2 = x[..., :half], x[..., half : self.dims]
            rotated = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        return rotated if self.dims == x.shape[-1] else mx.concatenate([rotated, x[..., self.dims :]], axis=-1)


class SwiGLUGate:
    """silu(gate(x)) * up(x) in float32 through the native kernel: both products and the gate in one op where the
    projections allow it, else the products and then one gate op; without the kernel, `elementwise.silu`."""

    def gated(self, x: mx.array) -> mx.array:
        if self.activation is not nn.silu or x.dtype != mx.float32:
            return super().gated(x)
        fused = gated_product(x, self.gate_proj, self.up_proj) if native.kernel is not None else None
        if fused is not None:
            return fused
        gate, up = self.gate_proj(x), self.up_proj(x)
        if native.kernel is not None and gate.dtype == up.dtype == mx.float32:
            return native.kernel.swiglu(gate, up)
        return elementwise.silu(gate) * up


class CpuGatedFFN(SwiGLUGate, GatedFFN):
    pass


class CpuSwiGLU(SwiGLUGate, SwiGLU):
    pass


class NativeNorm:
    """RMSNorm in one native op, where MLX's CPU `fast.rms_norm` is composed of five."""

    def __call__(self, x: mx.array) -> mx.array:
        scale = self.scale()
        if x.dtype == scale.dtype == mx.float32:
            return native.kernel.rms_norm(x, scale, self.eps)
        return super().__call__(x)


class NativeRMSNorm(NativeNorm, RMSNorm):
    pass


class NativeOffsetRMSNorm(NativeNorm, OffsetRMSNorm):
    pass


class NativeBlock(Block):
    """A pre-norm block whose one-token steps (the compiled decode step over a `FixedKVCache`, a batch's eager step over
    growing caches) run as one native op, `block_step`, which also writes the tokens' keys and values into the cache's
    buffers, where its parts are those the op computes (`StepPlan`): the step's 20 MLX ops a layer, each of which
    MLX schedules onto its CPU thread for several microseconds, become one. The op computes each part as that part's
    own native op does, so the step gives the same bits. Else the block as core wrote it."""

    def __call__(
        self, x: mx.array, cache=None, recorder: Recorder | None = None, positions: Positions | None = None
    ) -> mx.array:
        plan = step_plan(self) if recorder is None and self.residual_scale is None and steps_through(cache) else None
        if plan is None or not plan.takes(x, cache):
            return super().__call__(x, cache, recorder, positions)
        positions = positions or Positions.of(1, cache)
        mask = None if cache.can(Can.FIXED) else positions.mask(cache)  # a batch's padding
        cache.reserve(1)
        y, *buffers = native.kernel.block_step(
            *(x, cache.buffers, cache.start),
            plan.weights(),
            *positions.angles(plan.parts[2]),
            exact=block_inputs(x)["exact"] if plan.blocks else exact(),
            mask=mask,
            **plan.settings,
        )
        cache.written(buffers, 1)
        return y


def quantized(cache) -> bool:
    return cache is not None and cache.can(Can.QUANTIZED)


def steps_through(cache) -> bool:
    """Whether `block_step` can write one token into `cache`: a cache of `BUFFERS` (the compiled step's fixed cache, or
    a plain growing one, one sequence or a batch's, float or quantized) that holds tokens already."""
    return cache is not None and cache.can(Can.BUFFERS) and cache.buffers is not None


def parts_of(block: Block) -> tuple:
    """The parts of `block` that `block_step` reads: attn_norm, attn, rope, q, k, v, o, ffn_norm, ffn, gate, up, down
    (None where the block has no such part), read from the modules' own dicts, as a step a layer needs them fast (an
    MLX module's attribute costs a Python call)."""
    attn, ffn = block.get("attn"), block.get("ffn")
    attn_parts = [attn.get(name) for name in ("rope", "q_proj", "k_proj", "v_proj", "o_proj")] if attn else [None] * 5
    ffn_parts = [ffn.get(name) for name in ("gate_proj", "up_proj", "down_proj")] if ffn else [None] * 3
    return (block.get("attn_norm"), attn, *attn_parts, block.get("ffn_norm"), ffn, *ffn_parts)


class StepPlan:
    """What `block_step` takes of one block: its parts (`parts_of`) and, where the op computes them, the op's settings
    (None where it does not): RMS norms, attention without biases, query/key norms, windows, chunks, sinks, capped
    scores or query temperatures, RoPE unscaled, a SwiGLU feed-forward, and every projection packed on the kernel
    (affine, or GGUF blocks) without a bias (gate and up alike). Made once per block and kept while its parts are the
    same modules; the arrays are read at every step (`weights`), so that new weights (`Module.update`) are used."""

    def __init__(self, parts: tuple):
        self.parts = parts
        self.settings = self.settings_of(*parts)
        self.blocks = self.settings is not None and not any(self.settings["layouts"][0::2])  # GGUF blocks only

    @staticmethod
    def settings_of(attn_norm, attn, rope, q, k, v, o, ffn_norm, ffn, gate, up, down) -> dict | None:
        if type(attn) is not CpuAttention or type(ffn) not in (CpuGatedFFN, CpuSwiGLU) or ffn.activation is not nn.silu:
            return None
        if any(type(n) not in (NativeRMSNorm, NativeOffsetRMSNorm) for n in (attn_norm, ffn_norm)):
            return None
        if type(rope) is not CpuRoPE or rope.output_scale != 1.0 or attn.head_dim % 16:
            return None
        if "q_norm" in attn or "sinks" in attn or attn.window is not None or attn.logit_cap is not None:
            return None
        if attn.query_temperature is not None or attn.chunk is not None or attn.qk_norm_after_rope:
            return None
        if attn.output_gate:
            return None
        if any(type(p) not in STEP_PRODUCTS or "bias" in p for p in (q, k, v, o, gate, up, down)):
            return None
        if layout(gate) != layout(up):
            return None
        return {
            "layouts": [n for p in (q, k, v, o, up, down) for n in layout(p)],
            "heads": attn.heads,
            "kv_heads": attn.kv_heads,
            "rope_dims": rope.dims,
            "traditional": rope.traditional,
            "scale": attn.scale,
            "attn_eps": attn_norm.eps,
            "ffn_eps": ffn_norm.eps,
        }

    def takes(self, x: mx.array, cache) -> bool:
        """Whether the op computes this block's step of `x` over `cache`: one float32 token a row over float32 or
        float16 buffers, or quantized ones in groups of a multiple of 32 features."""
        if self.settings is None or x.shape[1] != 1 or x.dtype != mx.float32:
            return False
        if cache.can(Can.QUANTIZED):
            return cache.group_size % 32 == 0 and self.parts[1].head_dim % cache.group_size == 0
        buffers = cache.buffers
        return buffers[0].dtype in (mx.float32, mx.float16) and all(b.dtype == buffers[0].dtype for b in buffers)

    def weights(self) -> list[mx.array]:
        """The op's 23 weights: the attention norm's, q, k, v and o's (weight, scales, biases), the feed-forward
        norm's, up, gate and down's."""
        attn_norm, _, _, q, k, v, o, ffn_norm, _, gate, up, down = self.parts
        packed = [step_weights(p) for p in (q, k, v, o, up, gate, down)]
        return [attn_norm.scale(), *sum(packed[:4], []), ffn_norm.scale(), *sum(packed[4:], [])]


STEP_PRODUCTS = (NativeQuantizedLinear, NativeBlockLinear)
"""The linear maps whose products `block_step` computes: affine-packed in the kernel's layouts, or GGUF blocks."""


def layout(linear: NativeQuantizedLinear | NativeBlockLinear) -> tuple[int, int]:
    """A projection's layout as `block_step` takes it: (group_size, bits), or (0, ggml type) for GGUF blocks."""
    if type(linear) is NativeBlockLinear:
        return 0, linear.ggml_type
    return linear.group_size, linear.bits


def step_weights(linear: NativeQuantizedLinear | NativeBlockLinear) -> list[mx.array]:
    """A projection's (w, scales, biases) as `block_step` takes them: GGUF blocks hold their scales, and their weight
    stands in all three places."""
    if type(linear) is NativeBlockLinear:
        return [linear["weight"]] * 3
    return [linear["weight"], linear["scales"], linear["biases"]]


def step_plan(block: Block) -> StepPlan:
    """The block's `StepPlan`, made anew when one of its parts was replaced."""
    parts, plan = parts_of(block), block.__dict__.get("step_plan")
    if plan is None or any(a is not b for a, b in zip(parts, plan.parts)):
        plan = block.step_plan = StepPlan(parts)
    return plan


FORMS = {
    Transformer: CpuTransformer,
    Attention: CpuAttention,
    SharedKVAttention: CpuSharedKVAttention,
    RoPE: CpuRoPE,
    GatedFFN: CpuGatedFFN,
    SwiGLU: CpuSwiGLU,
}
"""Core part -> its CPU form, with or without the native kernel."""
NATIVE_FORMS = {
    nn.Linear: NativeLinear,
    RMSNorm: NativeRMSNorm,
    OffsetRMSNorm: NativeOffsetRMSNorm,
    Block: NativeBlock,
}
"""Core part -> its form on the native kernel, where it is installed."""


def use_cpu_forms(model: nn.Module) -> nn.Module:
    """Give every part of `model` whose type has a CPU form that form (the same object: parameters are not copied).
    Subclasses keep their own class: a plugin's part computes as its author wrote it."""
    forms = FORMS | NATIVE_FORMS if native.kernel is not None else FORMS
    for _, module in model.named_modules():
        form = forms.get(type(module))
        if form is not None:
            module.__class__ = form
    return model


CORE_PARTS = {form: part for part, form in (FORMS | NATIVE_FORMS).items()} | {
    NativeQuantizedLinear: QuantizedLinearByOps,  # MLX's CPU products read packed codes many times slower than this
    NativeQuantizedEmbedding: QuantizedEmbeddingByOps,
    NativeBlockLinear: BlockLinearByOps,  # weights held as GGUF blocks have no MLX module: dequantized as they are used
    NativeBlockEmbedding: BlockEmbeddingByOps,
    NativeBlockExperts: BlockExpertsByOps,
}
"""Each CPU form -> the core part (or MLX module) it computes differently."""


def use_core_forms(model: nn.Module) -> nn.Module:
    """Give every part of `model` in a CPU form its core part back (the same object): MLX's own ops, which have
    gradients, where the native kernel's have none. Training runs the model in these forms."""
    for _, module in model.named_modules():
        part = CORE_PARTS.get(type(module))
        if part is not None:
            module.__class__ = part
    return model
