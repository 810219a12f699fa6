"""The CPU forms of core parts, and the swap that puts them into a model that runs on the CPU.

Each form is its core part with one method computed differently where MLX's CPU backend composes many small
ops (or scalar ones) for what the native kernel, or a spelled-out formula, does in fewer: the parameters,
children and results are the core part's. Loading swaps a module's class for its form (`use_cpu_forms`), as
it swaps `Linear` for a quantized form where the file holds packed weights; reading core never requires
knowing which device runs it.
"""

import functools

import mlx.core as mx
import mlx.nn as nn

from ..core import (
    Attention,
    Block,
    Experts,
    GatedDeltaNet,
    GatedFFN,
    GatedRMSNorm,
    LayerInputBlock,
    MoE,
    OffsetRMSNorm,
    RMSNorm,
    RoPE,
    SharedKVAttention,
    SwiGLU,
    Transformer,
    UnscaledRMSNorm,
)
from ..core.cache import Can
from ..core.moe import swiglu
from ..core.positions import Positions
from ..core.recorder import Recorder
from . import attention, elementwise, native
from .linear import (
    GEGLU_ROWS,
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
    gelu_gated_product,
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
    projections allow it, else the products and then one gate op; without the kernel, `elementwise.silu`. A GeGLU's
    gelu_approx(gate(x)) * up(x) over GGUF blocks, for a few rows, in one op as well; else its gate is one op (the
    kernel's vectorized `geglu`, where MLX's CPU tanh is a scalar call per value: a prompt gates millions a layer)."""

    def gated(self, x: mx.array) -> mx.array:
        if self.activation is nn.gelu_approx and x.dtype == mx.float32 and native.kernel is not None:
            fused = gelu_gated_product(x, self.gate_proj, self.up_proj)
            if fused is not None:
                return fused
            gate, up = self.gate_proj(x), self.up_proj(x)
            if gate.dtype == up.dtype == mx.float32:
                return native.kernel.geglu(gate, up)
            return nn.gelu_approx(gate) * up
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


class NativeExperts(Experts):
    """`Experts` whose SwiGLU gate is the kernel's one vectorized op (MLX's CPU sigmoid is a scalar exp per value: a
    prompt's 8 experts a token gate millions of values a layer)."""

    def project(self, rows: mx.array, indices: mx.array, sort: bool) -> mx.array:
        if self.activation is not swiglu:
            return super().project(rows, indices, sort)
        gate, up = self.gate_proj(rows, indices, sort), self.up_proj(rows, indices, sort)
        if gate.dtype != mx.float32 or up.dtype != mx.float32:
            return self.down_proj(swiglu(gate, up), indices, sort)
        return self.down_proj(native.kernel.swiglu(gate, up), indices, sort)


class NativeMoE(MoE):
    """`MoE` whose steps over a few rows (a decode step's tokens, fewer (row, expert) pairs than `Experts.sort_from`)
    run as one native op, `block_moe`, where its parts are those the op computes (`moe_parts`): the 25 MLX ops of a
    step (scores, top-k, gathered products, weighted sum, shared expert) become one, and each row is quantized once for
    all its experts' products rather than once per expert. Else the mixture as core wrote it."""

    def __call__(self, x: mx.array) -> mx.array:
        parts = moe_parts(self) if x.dtype == mx.float32 else None
        if parts is None or x.size // x.shape[-1] * self.experts_per_token >= self.experts.sort_from:
            return super().__call__(x)
        router, weights, shared, types = parts
        y = native.kernel.block_moe(
            x.reshape(-1, x.shape[-1]),
            router.proj.weight,
            router.score_bias.astype(mx.float32) if "score_bias" in router else None,
            weights,
            shared,
            types,
            router.experts_per_token,
            router.scoring == "sigmoid",
            router.normalize,
            router.scale,
            exact=block_inputs(x)["exact"],
        )
        return y.reshape(x.shape)


def moe_parts(moe: MoE) -> tuple | None:
    """(router, the experts' [gate, up, down] weights, the shared expert's (or []), their ggml types) where `block_moe`
    computes `moe`: a router of one group whose scores are a float32 map's without a bias, read from x itself; SwiGLU
    experts held as GGUF blocks, without biases, each reading x unweighted; a shared SwiGLU expert (if any) held as
    GGUF blocks, without biases or a gate; else None."""
    router, experts, shared = moe.router, moe.experts, moe.get("shared_experts")
    if moe.weighted_inputs or "input_norm" in moe or "shared_gate" in moe:
        return None
    if "input_scale" in router or "expert_scale" in router or router.groups > 1:
        return None
    proj = router.proj
    if type(proj) is not NativeLinear or "bias" in proj or proj.weight.dtype != mx.float32:
        return None
    if type(experts) is not NativeExperts or experts.activation is not swiglu:
        return None
    projections = [experts.gate_proj, experts.up_proj, experts.down_proj]
    if any(type(p) is not NativeBlockExperts or "bias" in p for p in projections):
        return None
    if shared is not None:
        if type(shared) is not CpuSwiGLU or shared.activation is not nn.silu:
            return None
        shared_projections = [shared.gate_proj, shared.up_proj, shared.down_proj]
        if any(type(p) is not NativeBlockLinear or "bias" in p for p in shared_projections):
            return None
        projections += shared_projections
    weights = [p.weight for p in projections]
    return router, weights[:3], weights[3:], [p.ggml_type for p in projections]


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


class NativeUnscaledRMSNorm(UnscaledRMSNorm):
    """x / rms(x) in one native op (the kernel's rms_norm with a weight of ones), where MLX's CPU `fast.rms_norm`
    is composed of several."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32:
            return super().__call__(x)
        return native.kernel.rms_norm(x, ones(x.shape[-1]), self.eps)


@functools.cache
def ones(dims: int) -> mx.array:
    """A weight of ones, made once per width."""
    return mx.ones((dims,))


class NativeBlock(Block):
    """A pre-norm block whose one-token steps (the compiled decode step over a `FixedKVCache`, a batch's eager step over
    growing caches) run as one native op, `block_step`, which also writes the tokens' keys and values into the cache's
    buffers, where its parts are those the op computes (`StepPlan`): the step's 20 MLX ops a layer, each of which
    MLX schedules onto its CPU thread for several microseconds, become one. The op computes each part as that part's
    own native op does, so the step gives the same bits. A block whose feed-forward is a mixture of experts that
    `block_moe` computes takes the op for its attention's half (to mid), then the mixture's one op. Else the block
    as core wrote it."""

    def __call__(
        self, x: mx.array, cache=None, recorder: Recorder | None = None, positions: Positions | None = None
    ) -> mx.array:
        if recorder is None and self.residual_scale is None and type(self.get("attn")) is NativeGatedDeltaNet:
            plan = delta_plan(self)
            if plan.takes(x, cache):
                return plan.step(x, cache)
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
            biases=plan.biases(),
            **plan.settings,
        )
        cache.written(buffers, 1)
        return y + self.ffn_branch(y) if plan.attention_only else y


class NativeLayerInputBlock(LayerInputBlock):
    """`LayerInputBlock` whose layer input after the block, for a few rows (a decode step's), is one native op,
    `block_layer_input`, where its parts are those the op computes (a GELU-tanh gate and projection held as GGUF blocks
    without biases, a native RMS norm): the gate's product, GELU, the product with the layer's own input, the
    projection, its norm, the residual and the scalar, nine MLX ops, become one."""

    def __call__(
        self, x: mx.array, cache=None, recorder: Recorder | None = None, positions: Positions | None = None
    ) -> mx.array:
        if recorder is not None or not self.input_dims or not self.takes_layer_input(x):
            return super().__call__(x, cache, recorder, positions)
        h = super(LayerInputBlock, self).__call__(x, cache, recorder, positions)
        gate, proj, norm = self.input_gate, self.input_proj, self.input_norm
        return native.kernel.block_layer_input(
            *(h, gate.weight, gate.ggml_type, proj.weight, proj.ggml_type, positions.layer_input(self.layer)),
            *(norm.scale(), norm.eps, self.layer_scalar.astype(mx.float32)),
            exact=block_inputs(x)["exact"],
        )

    def takes_layer_input(self, x: mx.array) -> bool:
        if x.dtype != mx.float32 or x.size // x.shape[-1] >= GEGLU_ROWS or self.activation is not nn.gelu_approx:
            return False
        if type(self.input_norm) not in (NativeRMSNorm, NativeOffsetRMSNorm):
            return False
        return all(type(p) is NativeBlockLinear and "bias" not in p for p in (self.input_gate, self.input_proj))


class NativeGatedDeltaNet(GatedDeltaNet):
    """A Gated DeltaNet whose one-token steps over a held state run everything after the projections (convolution,
    normed q and k, gates, the delta rule, the gated norm) as one native op, `delta_step`, where MLX composes some
    forty small ops; prompts, padded passes and first tokens are the core layer's."""

    def mix(self, x: mx.array, cache) -> mx.array:
        if not self.steps(x, cache):
            return super().mix(x, cache)
        out, conv, state = native.kernel.delta_step(
            self.in_proj_qkv(x),
            cache.conv,
            self.conv1d.weight,
            self.in_proj_a(x),
            self.in_proj_b(x),
            self.in_proj_z(x),
            self.dt_bias,
            self.A_log,
            self.norm.weight,
            cache.recurrent,
            key_heads=self.key_heads,
            key_dims=self.key_dims,
            eps=self.norm.eps,
        )
        cache.update(conv, state, 1)
        return self.out_proj(out)

    def activate(self, qkv: mx.array) -> mx.array:
        """silu in one native op with a vectorized exp: MLX's CPU sigmoid calls the scalar exp per element, and a
        prompt's convolution outputs are thousands of channels a token."""
        return native.kernel.silu(qkv) if qkv.dtype == mx.float32 else super().activate(qkv)

    def steps(self, x: mx.array, cache) -> bool:
        """Whether `delta_step` computes this pass: one float32 token a row, without padding, over a float32 state, with
        float32 parameters and the plain gated norm."""
        if x.shape[1] != 1 or x.dtype != mx.float32 or cache is None or cache.recurrent is None or any(cache.padding):
            return False
        if "bias" in self.conv1d or self.norm.gate_first:
            return False
        held = (cache.conv, cache.recurrent, self.conv1d.weight, self.dt_bias, self.A_log, self.norm.weight)
        return all(a.dtype == mx.float32 for a in held)


class NativeGatedRMSNorm(GatedRMSNorm):
    """A gated RMSNorm whose gate's silu is one native op (see `NativeGatedDeltaNet.activate`)."""

    def opening(self, gate: mx.array) -> mx.array:
        return native.kernel.silu(gate)


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
    (None where it does not): RMS norms, attention without query/key norms, windows, chunks, sinks, capped scores or
    query temperatures, RoPE unscaled, a SwiGLU feed-forward (or a mixture `block_moe` computes: the op then ends at
    the attention's half, `attention_only`), and every projection packed on the kernel (affine, or GGUF blocks)
    without a bias (gate and up alike), but for float32 biases on all of q, k and v. Made once per block and kept while
    its parts are the same modules; the arrays are read at every step (`weights`), so that new weights (`Module.update`)
    are used."""

    def __init__(self, parts: tuple):
        self.parts = parts
        self.attention_only = type(parts[8]) is NativeMoE and moe_parts(parts[8]) is not None
        self.settings = self.settings_of(*parts, self.attention_only)
        self.blocks = self.settings is not None and not any(self.settings["layouts"][0::2])  # GGUF blocks only
        self.biased = self.settings is not None and "bias" in parts[3]

    @staticmethod
    def settings_of(attn_norm, attn, rope, q, k, v, o, ffn_norm, ffn, gate, up, down, attention_only) -> dict | None:
        if type(attn) is not CpuAttention:
            return None
        if not attention_only and (type(ffn) not in (CpuGatedFFN, CpuSwiGLU) or ffn.activation is not nn.silu):
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
        products = (q, k, v, o) if attention_only else (q, k, v, o, gate, up, down)
        if any(type(p) not in STEP_PRODUCTS for p in products) or any("bias" in p for p in products[3:]):
            return None
        if len({"bias" in p for p in (q, k, v)}) > 1 or not attention_only and layout(gate) != layout(up):
            return None
        if "bias" in q and any(p.bias.dtype != mx.float32 for p in (q, k, v)):
            return None
        return {
            "layouts": [n for p in products if p is not gate for n in layout(p)],
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
        norm's, up, gate and down's; the first 13 for the attention's half alone."""
        attn_norm, _, _, q, k, v, o, ffn_norm, _, gate, up, down = self.parts
        packed = [step_weights(p) for p in (q, k, v, o, up, gate, down)[: 4 if self.attention_only else 7]]
        if self.attention_only:
            return [attn_norm.scale(), *sum(packed, [])]
        return [attn_norm.scale(), *sum(packed[:4], []), ffn_norm.scale(), *sum(packed[4:], [])]

    def biases(self) -> list[mx.array] | None:
        """q's, k's and v's biases, where they have them."""
        return [p["bias"] for p in self.parts[3:6]] if self.biased else None


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
    return kept_plan(block, "step_plan", parts_of(block), StepPlan)


def kept_plan(block: Block, name: str, parts: tuple, make):
    """The plan `make(parts)` kept on `block` as `name`: made once, and anew when one of its parts was replaced."""
    plan = block.__dict__.get(name)
    if plan is None or any(a is not b for a, b in zip(parts, plan.parts)):
        plan = make(parts)
        setattr(block, name, plan)
    return plan


class DeltaBlockPlan:
    """What `delta_block_step` takes of a block around a `NativeGatedDeltaNet`: where its norms are RMS norms, its
    feed-forward a SwiGLU, and every projection GGUF blocks without a bias (gate and up of one type), the block's
    one-token steps are one op (its parts, read as `StepPlan` reads them, and the DeltaNet's). None of it otherwise."""

    def __init__(self, parts: tuple):
        self.parts = parts
        attn_norm, attn, ffn_norm, ffn, *products = parts
        fits = type(ffn) in (CpuGatedFFN, CpuSwiGLU) and ffn.activation is nn.silu
        fits = fits and all(type(n) in (NativeRMSNorm, NativeOffsetRMSNorm) for n in (attn_norm, ffn_norm))
        fits = fits and all(type(p) is NativeBlockLinear and "bias" not in p for p in products)
        self.types = (
            [p.ggml_type for p in products] if fits and products[5].ggml_type == products[6].ggml_type else None
        )

    @staticmethod
    def parts_of(block: Block) -> tuple:
        attn, ffn = block["attn"], block.get("ffn")
        projections = [attn.get(n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")]
        ffn_parts = [ffn.get(n) for n in ("gate_proj", "up_proj", "down_proj")] if ffn else [None] * 3
        return (block.get("attn_norm"), attn, block.get("ffn_norm"), ffn, *projections, *ffn_parts)

    def takes(self, x: mx.array, cache) -> bool:
        return self.types is not None and self.parts[1].steps(x, cache)

    def step(self, x: mx.array, cache) -> mx.array:
        attn_norm, attn, ffn_norm, _, qkv, z, a, b, out, gate, up, down = self.parts
        weights = [attn_norm.scale(), qkv.weight, z.weight, a.weight, b.weight, attn.conv1d.weight, attn.dt_bias]
        weights += [attn.A_log, attn.norm.weight, out.weight, ffn_norm.scale(), gate.weight, up.weight, down.weight]
        y, conv, state = native.kernel.delta_block_step(
            *(x, cache.conv, cache.recurrent, weights, self.types),
            key_heads=attn.key_heads,
            key_dims=attn.key_dims,
            eps=attn.norm.eps,
            attn_eps=attn_norm.eps,
            ffn_eps=ffn_norm.eps,
            exact=block_inputs(x)["exact"],
        )
        cache.update(conv, state, 1)
        return y


def delta_plan(block: Block) -> DeltaBlockPlan:
    """The block's `DeltaBlockPlan`, made anew when one of its parts was replaced."""
    return kept_plan(block, "delta_plan", DeltaBlockPlan.parts_of(block), DeltaBlockPlan)


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
    UnscaledRMSNorm: NativeUnscaledRMSNorm,
    Block: NativeBlock,
    MoE: NativeMoE,
    LayerInputBlock: NativeLayerInputBlock,
    Experts: NativeExperts,
    GatedDeltaNet: NativeGatedDeltaNet,
    GatedRMSNorm: NativeGatedRMSNorm,
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
