"""LLaMA 3 (and every checkpoint with `model_type: llama`).

Blocks: RMSNorm -> grouped-query attention with RoPE (plain, linear or llama3 scaling) ->
RMSNorm -> SwiGLU FFN. Head tied to the embedding or separate.
"""

from dataclasses import dataclass

import mlx.nn as nn

from ..core import Attention, Block, RMSNorm, RoPE, SwiGLU, Transformer
from ..io.config import normalize_config
from ..io.names import rename
from .registry import register

HF_NAMES = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.attn."),
    # a mixture of experts' router (its experts are stacked by `core.stack_experts`)
    (r"^model\.layers\.(\d+)\.mlp\.gate\.weight$", r"layers.\1.ffn.router.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers.\1.ffn.router.score_bias"),
    (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "head."),
]


@register("llama")
@dataclass
class Llama3Config:
    # A tiny model of this family in config.json form; `minimlx archs` builds it (lazily) to list the parts.
    example_config = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }

    vocab_size: int
    dims: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_dims: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    max_positions: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    tied_head: bool = False

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            dims=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            ffn_dims=c["intermediate_size"],
            norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_base=c.get("rope_theta", 10000.0),
            rope_scaling=c["rope_scaling"],
            max_positions=c.get("max_position_embeddings", 2048),
            attention_bias=c.get("attention_bias", False),
            mlp_bias=c.get("mlp_bias", False),
            tied_head=c.get("tie_word_embeddings", False),
        )

    def rope(self) -> RoPE:
        return RoPE(self.head_dim, self.rope_base, self.rope_scaling, self.max_positions)

    def attention(self) -> Attention:
        bias = self.attention_bias
        return Attention(self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), bias, bias)

    def ffn(self, layer: int) -> nn.Module:
        return SwiGLU(self.dims, self.ffn_dims, bias=self.mlp_bias)

    def block(self, layer: int) -> Block:
        """Pre-norm wiring: RMSNorm before attention and before the FFN."""
        return Block(
            self.attention(), self.ffn(layer), RMSNorm(self.dims, self.norm_eps), RMSNorm(self.dims, self.norm_eps)
        )

    def build(self) -> Transformer:
        blocks = [self.block(i) for i in range(self.layers)]
        head = None if self.tied_head else nn.Linear(self.dims, self.vocab_size, bias=False)
        return Transformer(nn.Embedding(self.vocab_size, self.dims), blocks, RMSNorm(self.dims, self.norm_eps), head)

    def convert_weights(self, weights: dict) -> dict:
        drop = [r"rotary_emb\.inv_freq$"] + ([r"^lm_head\."] if self.tied_head else [])
        return rename(weights, HF_NAMES, drop)
