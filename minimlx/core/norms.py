"""Normalisations: rescale each token's vector before a sub-layer reads it."""

import mlx.core as mx
import mlx.nn as nn

from .quantized import native_kernel


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`mx.fast.rms_norm`; on the CPU in float32 one op of the native kernel where it is installed, where MLX's
    own is composed of five (a decode step runs 61 of them)."""
    if mx.default_device() == mx.cpu and x.dtype == mx.float32 and weight.dtype == mx.float32:
        native = getattr(native_kernel(), "rms_norm", None)  # None too in a build older than the op
        if native is not None:
            return native(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    """x / rms(x) * weight: no centring, no bias (LLaMA, Qwen, DeepSeek)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): the weight stored as its difference from 1, so zeros mean no rescaling (Gemma)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__(dims, eps)
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, 1 + self.weight, self.eps)


class LayerNorm(nn.Module):
    """(x - mean) / std * weight + bias (GPT-2)."""

    def __init__(self, dims: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.weight = mx.ones((dims,))
        if bias:
            self.bias = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.layer_norm(x, self.weight, self.get("bias"), self.eps)
