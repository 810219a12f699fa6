"""A query temperature that grows with the position: long contexts' attention kept from flattening out.

Queries at position p are multiplied by `1 + beta * log(1 + floor((p + shift) / span))`: 1 for the first `span`
positions, then a slowly rising factor that sharpens the softmax as the keys multiply (Llama 4's layers without
RoPE, with shift 1; Mistral's 2025-26 models over the whole stack, with shift 0 and span the pre-yarn context).
"""

import mlx.core as mx

from .positions import Positions


class QueryTemperature:
    def __init__(self, beta: float, span: float, shift: float = 0.0):
        self.beta, self.span, self.shift = beta, span, shift

    def __call__(self, q: mx.array, positions: Positions) -> mx.array:
        """q (batch, heads, tokens, head_dim) scaled by its positions' factors, in q's dtype."""
        where = mx.maximum(positions.indices(), 0).astype(mx.float32)  # a padded row's padding sits before 0
        factor = 1 + self.beta * mx.log(1 + mx.floor((where + self.shift) / self.span))
        factor = factor[:, None, :, None] if factor.ndim == 2 else factor[:, None]
        return q * factor.astype(q.dtype)
