"""Top-k sparse attention: a small lightning indexer chooses, for each query, the `top_k` keys it attends to.

The indexer (DeepSeek Sparse Attention) scores every visible key for every query cheaply: `heads` small query heads
(from the query's low-rank code) against one small key per token (its own, normed and partly rotated), each head's
scores put through a ReLU and weighted by a per-token weight of that head, then summed over the heads. The
attention then sees only the `top_k` keys of highest index score, or every visible key while there are no more than
`top_k`. Where keys tie at the `top_k`-th score (keys every head scores at most 0), the ones kept are those torch's CPU
topk keeps (selection.py), as transformers does. The index keys are cached beside the attention's own.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import split_heads
from .cache import visible
from .norms import LayerNorm
from .positions import Positions
from .rope import RoPE
from .selection import kept


def full_mask(mask, tokens: int, keys: int) -> mx.array:
    """`mask` (None, "causal" or a boolean array, as attention takes it) as a boolean (tokens, keys) or
    (batch, 1, tokens, keys) array."""
    if mask is None:
        return mx.ones((tokens, keys), dtype=mx.bool_)
    if isinstance(mask, str):
        return visible(0, keys - tokens, tokens)
    return mask


def top_k_keys(scores: mx.array, k: int) -> mx.array:
    """Boolean (..., keys): the `k` highest `scores` of each row. A row whose k-th score is tied with scores past the
    k-th (which torch's topk then chooses among by its own algorithm) is read back and chosen by `kept`."""
    threshold = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)
    above, tied = scores > threshold, scores == threshold
    chosen = above | tied
    split = chosen.sum(axis=-1) > k  # rows whose ties do not all fit
    if not split.any().item():
        return chosen
    rows, chosen = scores.reshape(-1, scores.shape[-1]), np.array(chosen).reshape(-1, scores.shape[-1])
    for row in np.flatnonzero(np.array(split).reshape(-1)):
        chosen[row] = False
        chosen[row, kept(rows[row].tolist(), k)] = True
    return mx.array(chosen).reshape(scores.shape)


class Indexer(nn.Module):
    def __init__(self, dims: int, code_dims: int, heads: int, head_dim: int, rope: RoPE, top_k: int):
        super().__init__()
        self.q_proj = nn.Linear(code_dims, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dims, head_dim, bias=False)
        self.k_norm = LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dims, heads, bias=False)
        self.heads, self.head_dim, self.top_k = heads, head_dim, top_k
        self.rope = rope  # over the first `rope.dims` features of each head, rotate-half pairs

    def rotate(self, x: mx.array, positions: Positions) -> mx.array:
        turned, kept = mx.split(x, [self.rope.dims], axis=-1)
        return mx.concatenate([self.rope.rotate(turned, positions), kept], axis=-1)

    def keys(self, x: mx.array, positions: Positions) -> mx.array:
        """The index keys of the tokens of x (batch, tokens, dims): (batch, 1, tokens, head_dim)."""
        return self.rotate(self.k_norm(self.k_proj(x))[:, None], positions)

    def select(self, x: mx.array, code: mx.array, keys: mx.array, mask, positions: Positions) -> mx.array:
        """`mask` narrowed to the `top_k` keys of highest index score per query: boolean (tokens, keys) or
        (batch, 1, tokens, keys). x: the tokens (batch, tokens, dims); code: their query code (batch, tokens,
        code_dims); keys: every index key the queries see (batch, 1, keys, head_dim)."""
        tokens, count = x.shape[1], keys.shape[2]
        mask = full_mask(mask, tokens, count)
        if count <= self.top_k:
            return mask
        q = self.rotate(split_heads(self.q_proj(code), self.heads), positions)
        scores = mx.maximum((q.astype(mx.float32) @ keys.astype(mx.float32).swapaxes(-1, -2)) * self.head_dim**-0.5, 0)
        weights = self.weights_proj(x).astype(mx.float32) * self.heads**-0.5  # (batch, tokens, heads)
        index = (scores * weights.transpose(0, 2, 1)[..., None]).sum(axis=1)  # (batch, tokens, keys)
        index = mx.where(mask if mask.ndim == 2 else mask[:, 0], index, -mx.inf)
        return mask & top_k_keys(index, self.top_k)[:, None]
