"""softmax(q k^T * scale + mask) v for the attention parts: the one place that computes it.

On a GPU, and for masks other than causal, `mx.fast.scaled_dot_product_attention` does it. On the
CPU that function is a composed fallback: nine 128x64x128 products per SmolLM2 layer (one per query
head), the whole causal score matrix masked with `where` and a softmax whose exp is scalar; a
128-token prefill spent 4x torch's time there. `causal_attention` computes the same thing for a
chunk of queries over the cache: each key/value head's query heads stacked into one product, query
blocks that skip the keys after their last query, and `cpu_math.softmax`. Where the optional native
kernel is installed, its `causal_attention` does the same in one op that computes only the unmasked
scores (6x faster at 128 tokens; docs/performance.md), and queries under a boolean mask (a decode step over a
batch's padded rows, the padded prefill of a group of joiners, a sliding window) in one op too
(`masked_attention`), where MLX runs two products per head and row, a `where` and a softmax.
"""

import mlx.core as mx

from . import cpu_math
from .quantized import native_kernel

QUERY_BLOCK = 64


def attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: str | mx.array | None, sinks: mx.array | None = None
) -> mx.array:
    """q (batch, heads, queries, head_dim) over k, v (batch, kv_heads, keys, head_dim), to the shape of q.

    `mask` and `sinks` are those of `mx.fast.scaled_dot_product_attention`.
    """
    on_cpu = mx.default_device() == mx.cpu and q.dtype == mx.float32 and sinks is None
    if on_cpu and isinstance(mask, str) and mask == "causal":
        native = getattr(native_kernel(), "causal_attention", None)  # None too in a build older than the op
        if native is not None and q.shape[-1] % 16 == 0:
            return native(q, k, v, scale)
        return causal_attention(q, k, v, scale)
    native = native_kernel() if on_cpu and q.shape[-1] % 16 == 0 else None
    if native is not None and mask is None and q.shape[2] == 1:  # a decode step: its one query may see every key
        return native.causal_attention(q, k, v, scale)
    masked = getattr(native, "masked_attention", None)
    if masked is not None and isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        # The op hides what the mask hides and what causality does; every mask here (a cache's, `causal`'s)
        # already is causal, with each query at the end of the keys. Its shape: (batch or 1, 1, queries or 1, keys).
        if mask.ndim == 2 and q.shape[2] > 1:  # (queries, keys)
            mask = mask[None, None]
        elif mask.ndim <= 2 and q.shape[2] == 1:  # (keys,) or (batch, keys)
            mask = mask.reshape(-1, 1, 1, mask.shape[-1])
        if mask.ndim == 4 and mask.shape[1] == 1:
            return masked(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, block: int = QUERY_BLOCK) -> mx.array:
    """Query i (of `queries`, the last of `keys`) attends to keys 0 .. keys - queries + i; `block` queries at a time."""
    batch, heads, queries, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q = (q * scale).reshape(batch, kv_heads, group, queries, head_dim)
    past = keys - queries
    outputs = []
    for start in range(0, queries, block):
        stop = min(start + block, queries)
        seen = past + stop  # keys the block's last query sees; later keys are masked for the whole block
        rows = q[:, :, :, start:stop].reshape(batch, kv_heads, group * (stop - start), head_dim)
        scores = (rows @ k[:, :, :seen].swapaxes(-1, -2)).reshape(batch, kv_heads, group, stop - start, seen)
        hidden = mx.arange(seen)[None] > mx.arange(past + start, past + stop)[:, None]
        weights = cpu_math.softmax(mx.where(hidden, -mx.inf, scores))
        out = weights.reshape(batch, kv_heads, group * (stop - start), seen) @ v[:, :, :seen]
        outputs.append(out.reshape(batch, kv_heads, group, stop - start, head_dim))
    return mx.concatenate(outputs, axis=3).reshape(batch, heads, queries, head_dim)
