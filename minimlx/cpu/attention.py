"""softmax(q k^T * scale + mask) v on the CPU, where MLX's fused attention is a composed fallback.

On the CPU `mx.fast.scaled_dot_product_attention` runs one product per query head, masks the whole causal
score matrix with `where` and takes a softmax whose exp is scalar. `causal_attention` computes the same for a
chunk of queries over the cache: each key/value head's query heads stacked into one product, query blocks
that skip the keys after their last query, and `elementwise.softmax`. The native kernel, where it is
installed, does it in one op that computes only the unmasked scores (`causal_attention`), and queries under
a boolean mask (a decode step over a batch's padded rows, the padded prefill of a group of joiners, a
sliding window) in one op too (`masked_attention`), and over a quantized cache's codes (`quantized_attention`).
"""

import mlx.core as mx

from ..core.attention import quantized_attention
from . import elementwise, native

QUERY_BLOCK = 64


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, sinks: mx.array | None = None) -> mx.array:
    """q (batch, heads, queries, head_dim) over k, v (batch, kv_heads, keys, head_dim), to the shape of q;
    `mask` and `sinks` are those of `mx.fast.scaled_dot_product_attention`."""
    if q.dtype != mx.float32 or sinks is not None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    kernel = native.kernel if q.shape[-1] % 16 == 0 else None
    if isinstance(mask, str) and mask == "causal":
        return kernel.causal_attention(q, k, v, scale) if kernel is not None else causal_attention(q, k, v, scale)
    if kernel is not None and mask is None and q.shape[2] == 1:  # a decode step: its one query may see every key
        return kernel.causal_attention(q, k, v, scale)
    if kernel is not None and (shown := kernel_mask(mask, q.shape[2])) is not None:
        return kernel.masked_attention(q, k, v, scale, shown)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def attend_quantized(q: mx.array, k: tuple, v: tuple, scale: float, mask, group_size: int, bits: int) -> mx.array:
    """`attend` over keys and values a `QuantizedKVCache` holds: (codes, scales, biases) triples read by the native
    kernel's op where it is installed (its codes converted to floats as they are read), else `quantized_attention`."""
    kernel = native.kernel
    if kernel is not None and q.dtype == k[1].dtype == mx.float32 and group_size % 32 == 0:
        if mask is None or isinstance(mask, str) and mask == "causal":
            return kernel.quantized_attention(q, *k, *v, scale, group_size, bits)
        if (shown := kernel_mask(mask, q.shape[2])) is not None:
            return kernel.quantized_attention(q, *k, *v, scale, group_size, bits, shown)
    return quantized_attention(q, k, v, scale, mask, group_size, bits)


def kernel_mask(mask, queries: int) -> mx.array | None:
    """A boolean `mask` in the shape the kernel's masked ops take, (batch or 1, 1, queries or 1, keys), or None when it
    is no boolean array of a shape that becomes one. The ops hide what the mask hides and what causality does;
    every mask here (a cache's, `causal`'s) already is causal, with each query at the end of the keys."""
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        return None
    if mask.ndim == 2 and queries > 1:  # (queries, keys)
        mask = mask[None, None]
    elif mask.ndim <= 2 and queries == 1:  # (keys,) or (batch, keys)
        mask = mask.reshape(-1, 1, 1, mask.shape[-1])
    return mask if mask.ndim == 4 and mask.shape[1] == 1 else None


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
        weights = elementwise.softmax(mx.where(hidden, -mx.inf, scores))
        out = weights.reshape(batch, kv_heads, group * (stop - start), seen) @ v[:, :, :seen]
        outputs.append(out.reshape(batch, kv_heads, group, stop - start, head_dim))
    return mx.concatenate(outputs, axis=3).reshape(batch, heads, queries, head_dim)
