"""Scaled dot-product attention with grouped key/value heads.

Each of `heads` query heads attends over the keys and values of head `h // (heads / kv_heads)`:
multi-head attention when `kv_heads == heads`, grouped-query when fewer, multi-query when one.
"""

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCache
from .norms import RMSNorm
from .rope import RoPE
from .sdpa import attend


def causal(tokens: int) -> str | None:
    """The mask of `tokens` queries over themselves alone: causal, or none for a single token."""
    return "causal" if tokens > 1 else None


class Attention(nn.Module):
    """softmax(q k^T / sqrt(head_dim) + causal mask) v, projected back to the model width.

    With `qk_norm_eps`, queries and keys go through an RMSNorm before RoPE: each head on its own,
    or with `qk_norm_per_head=False` the whole projection (all heads) at once.
    """

    def __init__(
        self,
        dims: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rope: RoPE | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_per_head: bool = True,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dims, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dims, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dims, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, dims, bias=out_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim if qk_norm_per_head else heads * head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim if qk_norm_per_head else kv_heads * head_dim, qk_norm_eps)
        self.qk_norm_per_head = qk_norm_per_head
        self.rope = rope
        self.scale = head_dim**-0.5

    def __call__(self, x: mx.array, cache: KVCache | None = None) -> mx.array:
        batch, tokens, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if "q_norm" in self and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(batch, tokens, self.heads, self.head_dim)
        k = k.reshape(batch, tokens, self.kv_heads, self.head_dim)
        v = v.reshape(batch, tokens, self.kv_heads, self.head_dim)
        if "q_norm" in self and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        position, mask = (cache.position, cache.mask(tokens)) if cache is not None else (0, causal(tokens))
        if self.rope is not None:
            q, k = self.rope(q, position), self.rope(k, position)
        if cache is not None:
            k, v = cache.update(k, v)
        out = attend(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, tokens, -1))

    def make_cache(self) -> KVCache:
        return KVCache()
