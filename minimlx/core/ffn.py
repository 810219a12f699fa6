"""Position-wise feed-forward networks: widen, apply a non-linearity, project back."""

import mlx.core as mx
import mlx.nn as nn

from . import cpu_math
from .linear import native_swiglu
from .quantized import kernel_swiglu, native_kernel


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x); on the CPU in float32 through the native kernel's op (vectorized, on every core) where it
    is installed, else `cpu_math`'s exp: 3x faster there than MLX's."""
    if mx.default_device() == mx.cpu and x.dtype == mx.float32:
        native = getattr(native_kernel(), "silu", None)  # None too in a build older than the op
        return native(x) if native is not None else cpu_math.silu(x)
    return nn.silu(x)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up; one pass of the native kernel on the CPU in float32 where it is installed."""
    native = getattr(native_kernel(), "swiglu", None)  # None too in a build older than the op
    if native is not None and mx.default_device() == mx.cpu and gate.dtype == up.dtype == mx.float32:
        return native(gate, up)
    return silu(gate) * up


ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": silu,
}


class MLP(nn.Module):
    """down(act(up(x))): the two-matrix FFN of GPT-2 (GELU, exact or tanh-approximated)."""

    def __init__(self, dims: int, hidden_dims: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        self.up_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=bias)
        self.activation = ACTIVATIONS[activation]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.up_proj(x)))


class GatedFFN(nn.Module):
    """down(act(gate(x)) * up(x)): a gated FFN; GELU-tanh gates Gemma's (GeGLU)."""

    def __init__(self, dims: int, hidden_dims: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=bias)
        self.activation = ACTIVATIONS[activation]

    def __call__(self, x: mx.array) -> mx.array:
        if self.activation is silu:
            gated = kernel_swiglu(x, self.gate_proj, self.up_proj)
            gated = gated if gated is not None else native_swiglu(x, self.gate_proj, self.up_proj)
            return self.down_proj(gated if gated is not None else swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class SwiGLU(GatedFFN):
    """down(silu(gate(x)) * up(x)): the gated FFN of LLaMA, Qwen and DeepSeek."""

    def __init__(self, dims: int, hidden_dims: int, bias: bool = False):
        super().__init__(dims, hidden_dims, "silu", bias)
