"""Multi-head latent attention: keys and values of all heads rebuilt from one small latent per token.

Each token is compressed to a normed latent `c` (`latent_dims` numbers) and a key part `k_rope`
(`rope_dims` numbers, rotated, shared by all heads). Head h's key is `[W_uk[h] c, k_rope]` and its
value `W_uv[h] c`; only `[c, k_rope]` is cached. Checkpoints stack W_uk and W_uv of all heads in one
`kv_b_proj`; here they are two per-head maps (`key_up_proj` holds W_uk transposed, `value_up_proj`
W_uv), each quantizable along the dimension it contracts, as mlx-lm stores them.

Prompts expand the latents into full keys and values. A single new token instead moves W_uk to
the query side (`q_nope . W_uk c = (q_nope W_uk) . c`) and W_uv to the output side, so decoding
attends over the cached latents directly and never rebuilds the whole context's keys and values.
"""

from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .attention import merge_heads, record_attention, split_heads
from .cache import IndexedLatentCache, LatentCache
from .norms import RMSNorm
from .positions import Positions
from .quantized import QuantizedWeight
from .recorder import Recorder
from .rope import RoPE
from .sparse_attention import Indexer
from .temperature import QueryTemperature


class HeadLinear(nn.Module):
    """One `(out_dims, in_dims)` matrix per head: x (..., heads, tokens, in_dims) @ W[h]^T, or
    with `transpose=False` x (..., heads, tokens, out_dims) @ W[h]."""

    def __init__(self, in_dims: int, out_dims: int, heads: int):
        super().__init__()
        self.weight = mx.zeros((heads, out_dims, in_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ (self.weight.swapaxes(-1, -2) if transpose else self.weight)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedHeadLinear":
        return QuantizedHeadLinear(self.weight, group_size, bits, mode)


class QuantizedHeadLinear(QuantizedWeight):
    """`HeadLinear` with packed weights."""

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.get("biases"), transpose=transpose, **self.quantization()
        )


class LatentAttention(nn.Module):
    """Queries (nope_dims + rope_dims per head), optionally from a normed low-rank `q_lora_rank` code, scaled with their
    position after RoPE by `query_temperature` where given. With an `indexer` (which reads the query code), each
    query attends to the keys the indexer chooses for it only (top-k sparse attention)."""

    attends: ClassVar[bool] = True  # as `Attention.attends`

    def __init__(
        self,
        dims: int,
        heads: int,
        q_lora_rank: int | None,
        latent_dims: int,
        nope_dims: int,
        rope_dims: int,
        value_dims: int,
        rope: RoPE,
        scale: float,
        bias: bool = False,
        norm_eps: float = 1e-6,
        query_temperature: QueryTemperature | None = None,
        indexer: Indexer | None = None,
    ):
        super().__init__()
        self.heads, self.latent_dims = heads, latent_dims
        self.nope_dims, self.rope_dims, self.value_dims = nope_dims, rope_dims, value_dims
        query_dims = heads * (nope_dims + rope_dims)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(dims, query_dims, bias=False)
        else:
            self.q_a_proj = nn.Linear(dims, q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, query_dims, bias=False)
        self.kv_a_proj = nn.Linear(dims, latent_dims + rope_dims, bias=bias)
        self.kv_a_norm = RMSNorm(latent_dims, norm_eps)
        self.key_up_proj = HeadLinear(nope_dims, latent_dims, heads)
        self.value_up_proj = HeadLinear(latent_dims, value_dims, heads)
        self.o_proj = nn.Linear(heads * value_dims, dims, bias=bias)
        self.rope = rope
        self.scale = scale
        self.query_temperature = query_temperature
        if indexer is not None:
            self.indexer = indexer

    def __call__(
        self,
        x: mx.array,
        cache: LatentCache | None = None,
        recorder: Recorder | None = None,
        positions: Positions | None = None,
    ) -> mx.array:
        positions = positions or Positions.of(x.shape[1], cache)
        code = None if "q_proj" in self else self.q_a_norm(self.q_a_proj(x))
        q = split_heads(self.q_proj(x) if code is None else self.q_b_proj(code), self.heads)
        q_nope, q_rope = mx.split(q, [self.nope_dims], axis=-1)
        latent, k_rope = mx.split(self.kv_a_proj(x)[:, None], [self.latent_dims], axis=-1)
        mask = positions.mask(cache)
        q_rope, k_rope = self.rope.rotate(q_rope, positions), self.rope.rotate(k_rope, positions)
        if self.query_temperature is not None:
            q_nope, q_rope = self.query_temperature(q_nope, positions), self.query_temperature(q_rope, positions)
        latent_keys = mx.concatenate([self.kv_a_norm(latent), k_rope], axis=-1)  # (batch, 1, tokens, latent + rope)
        if "indexer" in self:
            index_keys = self.indexer.keys(x, positions)
            if cache is not None:
                latent_keys, index_keys = cache.update(latent_keys, index_keys)
            mask = self.indexer.select(x, code, index_keys, mask, positions)
        elif cache is not None:
            latent_keys = cache.update(latent_keys)
        if positions.tokens == 1 and recorder is None:
            out = self._absorbed(q_nope, q_rope, latent_keys, mask)
        else:
            out = self._expanded(q_nope, q_rope, latent_keys, mask, recorder)
        return self.o_proj(merge_heads(out))

    def _expanded(self, q_nope, q_rope, latent_keys, mask, recorder: Recorder | None = None) -> mx.array:
        """Full per-head keys and values from the latents, then causal attention (the path a recorder sees)."""
        latent, k_rope = mx.split(latent_keys, [self.latent_dims], axis=-1)
        k_nope, values = self.key_up_proj(latent, transpose=False), self.value_up_proj(latent)
        keys = mx.concatenate([k_nope, mx.broadcast_to(k_rope, (*k_nope.shape[:-1], self.rope_dims))], axis=-1)
        queries = mx.concatenate([q_nope, q_rope], axis=-1)
        if recorder is not None:
            record_attention(recorder, queries, keys, self.scale, mask)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)

    def _absorbed(self, q_nope, q_rope, latent_keys, mask) -> mx.array:
        """Attention in latent space: queries through W_uk, one shared latent 'head', output through W_uv.

        The cached rows serve as keys and, whole (a slice would be copied), as values; the rope
        part of the result is dropped.
        """
        queries = mx.concatenate([self.key_up_proj(q_nope), q_rope], axis=-1)  # (batch, heads, 1, latent + rope)
        out = mx.fast.scaled_dot_product_attention(queries, latent_keys, latent_keys, scale=self.scale, mask=mask)
        return self.value_up_proj(out[..., : self.latent_dims])

    def make_cache(self) -> LatentCache | IndexedLatentCache:
        return IndexedLatentCache() if "indexer" in self else LatentCache()
