"""GPT-2: learned position embeddings, LayerNorm, multi-head attention, a GELU MLP, tied head."""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..core import MLP, Attention, Block, LayerNorm, Transformer
from ..io.config import normalize_config
from ..io.names import rename
from .registry import register

HF_NAMES = [
    (r"^wte\.", "embed."),
    (r"^wpe\.", "positions."),
    (r"^h\.(\d+)\.ln_1\.", r"layers.\1.attn_norm."),
    (r"^h\.(\d+)\.ln_2\.", r"layers.\1.ffn_norm."),
    (r"^h\.(\d+)\.attn\.c_proj\.", r"layers.\1.attn.o_proj."),
    (r"^h\.(\d+)\.mlp\.c_fc\.", r"layers.\1.ffn.up_proj."),
    (r"^h\.(\d+)\.mlp\.c_proj\.", r"layers.\1.ffn.down_proj."),
    (r"^ln_f\.", "norm."),
]


@register("gpt2")
@dataclass
class GPT2Config:
    # A tiny model of this family in config.json form; `minimlx archs` builds it (lazily) to list the parts.
    example_config = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32}

    vocab_size: int = 50257
    dims: int = 768
    layers: int = 12
    heads: int = 12
    max_positions: int = 1024
    ffn_dims: int | None = None
    norm_eps: float = 1e-5
    activation: str = "gelu_new"

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        return cls(
            vocab_size=c.get("vocab_size", 50257),
            dims=c.get("n_embd", 768),
            layers=c.get("n_layer", 12),
            heads=c.get("n_head", 12),
            max_positions=c.get("n_positions") or c.get("n_ctx", 1024),
            ffn_dims=c.get("n_inner"),
            norm_eps=c.get("layer_norm_epsilon", 1e-5),
            activation=c.get("activation_function", "gelu_new"),
        )

    def build(self) -> Transformer:
        head_dim = self.dims // self.heads
        blocks = [
            Block(
                Attention(self.dims, self.heads, self.heads, head_dim, rope=None, qkv_bias=True, out_bias=True),
                MLP(self.dims, self.ffn_dims or 4 * self.dims, self.activation),
                LayerNorm(self.dims, self.norm_eps),
                LayerNorm(self.dims, self.norm_eps),
            )
            for _ in range(self.layers)
        ]
        return Transformer(
            nn.Embedding(self.vocab_size, self.dims),
            blocks,
            LayerNorm(self.dims, self.norm_eps),
            head=None,
            positions=nn.Embedding(self.max_positions, self.dims),
        )

    def convert_weights(self, weights: dict) -> dict:
        """Strip `transformer.`, transpose Conv1D (in, out) weights, split the fused q/k/v projection."""
        weights = {name.removeprefix("transformer."): w for name, w in weights.items()}
        out = {}
        for name, w in weights.items():
            if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")) and w.ndim == 2:
                w = w.T
            if ".attn.c_attn." in name:
                prefix = name.split(".attn.c_attn.")[0].replace("h.", "layers.", 1) + ".attn."
                kind = name.rsplit(".", 1)[1]
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), mx.split(w, 3, axis=0)):
                    out[f"{prefix}{proj}.{kind}"] = part
            else:
                out[name] = w
        return rename(out, HF_NAMES, drop=[r"\.attn\.(masked_)?bias$", r"^lm_head\."])
