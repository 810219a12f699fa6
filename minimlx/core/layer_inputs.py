"""Per-layer inputs: besides the residual stream, each layer reads an input of its own made from the tokens."""

import mlx.core as mx
import mlx.nn as nn

from .norms import RMSNorm


class PerLayerInputs(nn.Module):
    """Each of `layers` layers' own `dims`-wide input for every token: the token's row of a second embedding (all
    layers' inputs side by side, times sqrt(dims)), plus the token's embedded vector projected to the same width
    (times 1/sqrt(model_dims)) and RMS-normed per layer; the two summed, times 1/sqrt(2)."""

    def __init__(self, vocab_size: int, model_dims: int, layers: int, dims: int, eps: float):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, layers * dims)
        self.proj = nn.Linear(model_dims, layers * dims, bias=False)
        self.norm = RMSNorm(dims, eps)
        self.layers, self.dims, self.model_dims = layers, dims, model_dims

    def __call__(self, ids: mx.array, embedded: mx.array) -> mx.array:
        """ids (batch, tokens) and their scaled embedding (batch, tokens, model_dims) -> (batch, tokens, layers,
        dims)."""
        own = self.embed(ids)
        own = (own * mx.array(self.dims**0.5, dtype=own.dtype)).reshape(*ids.shape, self.layers, self.dims)
        projected = self.proj(embedded) * mx.array(self.model_dims**-0.5, dtype=embedded.dtype)
        projected = self.norm(projected.reshape(*ids.shape, self.layers, self.dims))
        return (projected + own) * mx.array(2**-0.5, dtype=projected.dtype)
