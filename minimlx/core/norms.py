"""Normalisations: rescale each token's vector before a sub-layer reads it."""

import mlx.core as mx
import mlx.nn as nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight: no centring, no bias (LLaMA, Qwen, DeepSeek)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def scale(self) -> mx.array:
        """What the normalised vector is multiplied by."""
        return self.weight

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.scale(), self.eps)


class OffsetRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): the weight stored as its difference from 1, so zeros mean no rescaling (Gemma)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__(dims, eps)
        self.weight = mx.zeros((dims,))

    def scale(self) -> mx.array:
        return 1 + self.weight


class UnscaledRMSNorm(nn.Module):
    """x / rms(x), with no weight: every feature kept at unit root mean square (Llama 4's query and key norm)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, self.eps)


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
