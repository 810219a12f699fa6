"""Scaled dot-product attention with grouped key/value heads.

Each of `heads` query heads attends over the keys and values of head `h // (heads / kv_heads)`:
multi-head attention when `kv_heads == heads`, grouped-query when fewer, multi-query when one.
"""

from collections.abc import Callable
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .cache import Can, ChunkedKVCache, KVCache, RotatingKVCache, SharedKVCache, visible
from .norms import RMSNorm, UnscaledRMSNorm
from .positions import LentKV, Positions
from .recorder import Recorder
from .rope import RoPE
from .temperature import QueryTemperature


def split_heads(x: mx.array, heads: int) -> mx.array:
    """(batch, tokens, heads * head_dim) -> (batch, heads, tokens, head_dim). One token's values lie in the same
    order either way, so a decode step's split is a reshape alone: one op instead of two."""
    batch, tokens, width = x.shape
    if tokens == 1:
        return x.reshape(batch, heads, 1, width // heads)
    return x.reshape(batch, tokens, heads, width // heads).transpose(0, 2, 1, 3)


def merge_heads(x: mx.array) -> mx.array:
    """(batch, heads, tokens, head_dim) -> (batch, tokens, heads * head_dim), the inverse of `split_heads`."""
    batch, _, tokens, _ = x.shape
    if tokens == 1:
        return x.reshape(batch, 1, -1)
    return x.transpose(0, 2, 1, 3).reshape(batch, tokens, -1)


def soft_cap(x: mx.array, cap: float) -> mx.array:
    """cap * tanh(x / cap): x squashed smoothly into (-cap, cap), nearly unchanged where |x| << cap."""
    return mx.tanh(x / cap) * cap


def attention_weights(q, k, scale: float, mask, cap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """softmax(soft_cap(q k^T * scale) + mask) over the keys: the weights attention applies to the values,
    (batch, heads, queries, keys) in float32, 0 where the mask hides a key.

    q: (batch, heads, tokens, head_dim); k: (batch, kv_heads, keys, head_dim), each read by heads // kv_heads
    query heads; scores are soft-capped when `cap` is given. With `sinks`, each head's learned logit joins the
    softmax as a column of its own that takes its share and is then dropped: a row sums to 1 minus that share.
    """
    batch, heads, tokens, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    q = q.reshape(batch, kv_heads, heads // kv_heads, tokens, -1)  # the query heads that share each kv head
    scores = (q * scale) @ k[:, :, None].swapaxes(-1, -2)
    scores = (scores if cap is None else soft_cap(scores, cap)).astype(mx.float32)
    if isinstance(mask, str):
        mask = visible(0, keys - tokens, tokens) if mask == "causal" else None
    if mask is not None:
        scores = mx.where(mask[:, :, None] if mask.ndim == 4 else mask, scores, -mx.inf)
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, kv_heads, -1, 1, 1), (*scores.shape[:-1], 1))
        scores = mx.concatenate([sink, scores], axis=-1)
    return mx.softmax(scores, axis=-1)[..., -keys:].reshape(batch, heads, tokens, keys)


def capped_attention(q, k, v, scale: float, mask, cap: float, sinks: mx.array | None = None) -> mx.array:
    """softmax(soft_cap(q k^T * scale) + mask) v, spelled out: the fused kernel cannot cap scores.

    q: (batch, heads, tokens, head_dim); k, v: (batch, kv_heads, keys, head_dim); `sinks` as for
    `attention_weights`.
    """
    batch, heads, tokens, _ = q.shape
    kv_heads = k.shape[1]
    weights = attention_weights(q, k, scale, mask, cap, sinks).astype(v.dtype)
    weights = weights.reshape(batch, kv_heads, heads // kv_heads, tokens, -1)  # grouped as the kv heads they read
    return (weights @ v[:, :, None]).reshape(batch, heads, tokens, -1)


def quantized_attention(q, k, v, scale: float, mask, group_size: int, bits: int) -> mx.array:
    """softmax(q k^T * scale + mask) v with k and v quantized, (codes, scales, biases) triples as `mx.quantize` gives
    them: both products read the codes through `mx.quantized_matmul`, nothing is dequantized.

    q: (batch, heads, tokens, head_dim); k, v: triples of (batch, kv_heads, keys, ...); `mask` as
    `mx.fast.scaled_dot_product_attention` takes it (None, "causal" or a boolean array).
    """
    batch, heads, tokens, _ = q.shape
    kv_heads, keys = k[0].shape[1], k[0].shape[2]
    q = (q * scale).reshape(batch, kv_heads, heads // kv_heads, tokens, -1)  # the query heads that share each kv head
    k, v = [a[:, :, None] for a in k], [a[:, :, None] for a in v]
    scores = mx.quantized_matmul(q, *k, transpose=True, group_size=group_size, bits=bits)
    if isinstance(mask, str):
        mask = visible(0, keys - tokens, tokens) if mask == "causal" else None
    if mask is not None:
        scores = mx.where(mask[:, :, None] if mask.ndim == 4 else mask, scores, -mx.inf)
    weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    out = mx.quantized_matmul(weights, *v, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(batch, heads, tokens, -1)


def record_attention(recorder: Recorder, q, k, scale: float, mask, cap: float | None = None, sinks=None) -> None:
    """Hand a recorder the queries and keys (after RoPE) and, only when it wants them, the weights they give."""
    recorder(queries=q, keys=k)
    if recorder.wants("attn_weights"):
        recorder(attn_weights=attention_weights(q, k, scale, mask, cap, sinks))


class Attention(nn.Module):
    """softmax(q k^T * scale + mask) v, projected back to the model width; `scale` is 1/sqrt(head_dim) unless given.

    With `qk_norm_eps`, queries and keys go through a norm (`qk_norm`, an RMSNorm unless given) before RoPE:
    each head on its own, or with `qk_norm_per_head=False` the whole projection (all heads) at once.
    With `window`, each token sees only itself and the `window - 1` tokens before it (sliding-window
    attention; its cache keeps just those). With `sinks`, each head has a learned logit `sinks[h]` that
    joins the softmax and soaks up attention without adding any value. With `logit_cap`, scores are
    soft-capped (`soft_cap`) before the mask and softmax. With `query_temperature`, queries are scaled by a
    factor of their position (`QueryTemperature`) after RoPE. With `chunk`, the text is cut into chunks of that many
    tokens and each token sees only those before it in its own chunk (chunked local attention; its cache keeps at
    most one chunk). With `qk_norm_after_rope`, the per-head query and key norms come after RoPE instead of before.
    With `output_gate`, q_proj is twice as wide (each head's queries, then its gate) and the heads' output is
    multiplied by sigmoid(gate) before the output projection. With `values_from_keys`, there is no v_proj: the values
    are the keys' projection itself (before the key norm and RoPE). With `value_norm_eps`, each value head goes
    through a weightless RMSNorm. With `lends` (its layer's index), the keys and values it attends over in a pass,
    cached ones included, are lent to the later layers that attend over them too (`SharedKVAttention`).
    """

    attends: ClassVar[bool] = True
    """A token-mixer's declaration: its tokens read each other through attention weights over `heads` query heads
    (a trace records its queries, keys and weights; an ablation switches heads off). A recurrent layer has none."""

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
        window: int | None = None,
        sinks: bool = False,
        scale: float | None = None,
        logit_cap: float | None = None,
        qk_norm: Callable[[int, float], nn.Module] = RMSNorm,
        query_temperature: QueryTemperature | None = None,
        chunk: int | None = None,
        qk_norm_after_rope: bool = False,
        output_gate: bool = False,
        values_from_keys: bool = False,
        value_norm_eps: float | None = None,
        lends: int | None = None,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(dims, heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(dims, kv_heads * head_dim, bias=qkv_bias)
        if not values_from_keys:
            self.v_proj = nn.Linear(dims, kv_heads * head_dim, bias=qkv_bias)
        if value_norm_eps is not None:
            self.v_norm = UnscaledRMSNorm(head_dim, value_norm_eps)
        self.values_from_keys, self.lends = values_from_keys, lends
        self.o_proj = nn.Linear(heads * head_dim, dims, bias=out_bias)
        if qk_norm_eps is not None:
            self.q_norm = qk_norm(head_dim if qk_norm_per_head else heads * head_dim, qk_norm_eps)
            self.k_norm = qk_norm(head_dim if qk_norm_per_head else kv_heads * head_dim, qk_norm_eps)
        if sinks:
            self.sinks = mx.zeros((heads,))
        self.qk_norm_per_head = qk_norm_per_head
        self.rope = rope
        self.window, self.logit_cap = window, logit_cap
        self.query_temperature = query_temperature
        self.chunk, self.qk_norm_after_rope = chunk, qk_norm_after_rope
        self.scale = head_dim**-0.5 if scale is None else scale

    def __call__(
        self,
        x: mx.array,
        cache: KVCache | None = None,
        recorder: Recorder | None = None,
        positions: Positions | None = None,
    ) -> mx.array:
        """x: (batch, tokens, dims), continuing `cache` if given; `positions` are the forward pass's."""
        positions = positions or Positions.of(x.shape[1], cache)
        q, k = self.q_proj(x), self.k_proj(x)
        v = k if self.values_from_keys else self.v_proj(x)
        gate = None
        if self.output_gate:
            q, gate = self.split_gate(q)
        if "q_norm" in self and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = split_heads(q, self.heads), split_heads(k, self.kv_heads), split_heads(v, self.kv_heads)
        head_norms = "q_norm" in self and self.qk_norm_per_head
        if head_norms and not self.qk_norm_after_rope:  # over each head's features, whatever the axes' order
            q, k = self.q_norm(q), self.k_norm(k)
        if "v_norm" in self:
            v = self.v_norm(v)
        mask = positions.mask(cache, self.window, self.chunk)
        if self.rope is not None:
            q, k = self.rope.rotate(q, positions), self.rope.rotate(k, positions)
        if head_norms and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_temperature is not None:
            q = self.query_temperature(q, positions)
        if cache is not None:
            k, v = cache.update(*self.cached(k, v, cache))
        if self.lends is not None:
            positions.lend(self.lends, LentKV(k, v, mask, cache))
        return self.attend_over(q, k, v, mask, cache, recorder, gate)

    def attend_over(self, q: mx.array, k, v, mask, cache, recorder: Recorder | None, gate) -> mx.array:
        """The heads' output over keys and values as `cache` holds them (quantized or not), projected back."""
        sinks = self.get("sinks")
        if cache is not None and cache.can(Can.QUANTIZED):
            if recorder is None and self.logit_cap is None and sinks is None:
                return self.project(self.attend_quantized(q, k, v, mask, cache.group_size, cache.bits), gate)
            k, v = cache.dequantize(k), cache.dequantize(v)  # what a recorder reads, and the capped or sunk forms
        if recorder is not None:
            record_attention(recorder, q, k, self.scale, mask, self.logit_cap, sinks)
        if self.logit_cap is None:
            out = self.attend(q, k, v, mask, sinks)
        else:
            out = capped_attention(q, k, v, self.scale, mask, self.logit_cap, sinks)
        return self.project(out, gate)

    def split_gate(self, q: mx.array) -> tuple[mx.array, mx.array]:
        """q_proj's doubled output (batch, tokens, heads * 2 * head_dim) -> the queries and the output gate."""
        batch, tokens, _ = q.shape
        q, gate = mx.split(q.reshape(batch, tokens, self.heads, 2 * self.head_dim), 2, axis=-1)
        return q.reshape(batch, tokens, -1), gate.reshape(batch, tokens, -1)

    def project(self, out: mx.array, gate: mx.array | None) -> mx.array:
        """The heads' output (batch, heads, tokens, head_dim), gated where the layer has a gate, projected back."""
        out = merge_heads(out)
        return self.o_proj(out if gate is None else out * mx.sigmoid(gate))

    def cached(self, k: mx.array, v: mx.array, cache) -> tuple[mx.array, mx.array]:
        """This step's keys and values as `cache` is to hold them: as computed. A device form may hold them in fewer
        bytes where its attention reads those."""
        return k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask, sinks: mx.array | None) -> mx.array:
        """softmax(q k^T * scale + mask) v for q (batch, heads, queries, head_dim) over k, v (batch, kv_heads,
        keys, head_dim), with `mask` and `sinks` as `mx.fast.scaled_dot_product_attention` takes them."""
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask, sinks=sinks)

    def attend_quantized(self, q: mx.array, k: tuple, v: tuple, mask, group_size: int, bits: int) -> mx.array:
        """`attend` over keys and values held quantized (a `Quantized` cache's triples)."""
        return quantized_attention(q, k, v, self.scale, mask, group_size, bits)

    def make_cache(self) -> KVCache:
        """A growing cache, or for a windowed layer one that keeps only the window, for a chunked one only the
        current chunk."""
        if self.chunk is not None:
            return ChunkedKVCache(self.chunk)
        return KVCache() if self.window is None else RotatingKVCache(self.window)


class SharedKVAttention(Attention):
    """Attention over the keys and values an earlier layer (`source`, whose `Attention` lends them) attends over in
    the same pass (KV shared across layers): queries of its own (projected, normed, rotated), no key or value
    projections, and a cache (`SharedKVCache`) that only counts the tokens, the source's cache holding their keys
    and values. The mask is the source's, so a windowed source gives a windowed layer."""

    def __init__(
        self,
        dims: int,
        heads: int,
        head_dim: int,
        source: int,
        rope: RoPE | None = None,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
        qk_norm: Callable[[int, float], nn.Module] = RMSNorm,
    ):
        nn.Module.__init__(self)
        self.heads, self.head_dim, self.source = heads, head_dim, source
        self.q_proj = nn.Linear(dims, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dims, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = qk_norm(head_dim, qk_norm_eps)
        self.rope, self.logit_cap, self.output_gate = rope, None, False
        self.scale = head_dim**-0.5 if scale is None else scale

    def __call__(
        self,
        x: mx.array,
        cache: SharedKVCache | None = None,
        recorder: Recorder | None = None,
        positions: Positions | None = None,
    ) -> mx.array:
        positions = positions or Positions.of(x.shape[1], cache)
        q = split_heads(self.q_proj(x), self.heads)
        if "q_norm" in self:
            q = self.q_norm(q)
        if self.rope is not None:
            q = self.rope.rotate(q, positions)
        lent = positions.borrowed(self.source)
        if cache is not None:
            cache.update(x.shape[1])
        return self.attend_over(q, lent.keys, lent.values, lent.mask, lent.cache, recorder, None)

    def make_cache(self) -> SharedKVCache:
        return SharedKVCache()
