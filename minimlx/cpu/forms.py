"""The CPU forms of core parts, and the swap that puts them into a model that runs on the CPU.

Each form is its core part with one method computed differently where MLX's CPU backend composes many small
ops (or scalar ones) for what the native kernel, or a spelled-out formula, does in fewer: the parameters,
children and results are the core part's. Loading swaps a module's class for its form (`use_cpu_forms`), as
it swaps `Linear` for a quantized form where the file holds packed weights; reading core never requires
knowing which device runs it.
"""

import mlx.core as mx
import mlx.nn as nn

from ..core import Attention, GatedFFN, OffsetRMSNorm, RMSNorm, RoPE, SwiGLU, Transformer
from ..core.cache import GrowingBuffer
from ..core.positions import Positions
from . import attention, elementwise, native
from .linear import NativeLinear, gated_product


class CpuTransformer(Transformer):
    """The one loop, with each layer of a one-token step queued as soon as it is built.

    MLX's CPU `async_eval` computes all but the last ~100 ops of what it is given before it returns, so a step
    queued whole leaves the CPU idle while Python builds the graph, and Python idle while it is computed; queued
    per layer, layer i computes while layer i + 1 is built. Only over growing caches (the engine's eager decode):
    a compiled step is one replayed graph, and a recorder wants the whole pass.
    """

    def run_layer(self, layer: nn.Module, x: mx.array, cache, recorder, positions: Positions):
        x = layer(x, cache, recorder, positions)
        if positions.tokens == 1 and recorder is None and isinstance(cache, GrowingBuffer):
            mx.async_eval(x)
        return x


class CpuAttention(Attention):
    """Attention through `cpu.attention.attend` (the native kernel's ops, or blocked causal attention)."""

    def attend(self, q, k, v, mask, sinks):
        return attention.attend(q, k, v, self.scale, mask, sinks)

    def attend_quantized(self, q, k, v, mask, group_size, bits):
        return attention.attend_quantized(q, k, v, self.scale, mask, group_size, bits)


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


FORMS = {
    Transformer: CpuTransformer,
    Attention: CpuAttention,
    RoPE: CpuRoPE,
    GatedFFN: CpuGatedFFN,
    SwiGLU: CpuSwiGLU,
}
"""Core part -> its CPU form, with or without the native kernel."""
NATIVE_FORMS = {nn.Linear: NativeLinear, RMSNorm: NativeRMSNorm, OffsetRMSNorm: NativeOffsetRMSNorm}
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
