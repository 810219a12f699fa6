"""Position-wise feed-forward networks: widen, apply a non-linearity, project back."""

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "quick_gelu": nn.gelu_fast_approx,  # x * sigmoid(1.702 x)
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

    def gated(self, x: mx.array) -> mx.array:
        """act(gate(x)) * up(x): what the down projection reads."""
        return self.activation(self.gate_proj(x)) * self.up_proj(x)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.gated(x))


class SwiGLU(GatedFFN):
    """down(silu(gate(x)) * up(x)): the gated FFN of LLaMA, Qwen and DeepSeek."""

    def __init__(self, dims: int, hidden_dims: int, bias: bool = False):
        super().__init__(dims, hidden_dims, "silu", bias)
