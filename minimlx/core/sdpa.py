"""softmax(q k^T * scale + mask) v for the attention parts: the one place that computes it."""

import mlx.core as mx


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None) -> mx.array:
    """q (batch, heads, queries, head_dim) over k, v (batch, kv_heads, keys, head_dim) -> (batch, heads, queries, head_dim)."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
