"""LLaMA 3 (and every checkpoint with `model_type: llama`).

Blocks: RMSNorm -> grouped-query attention with RoPE (plain, linear or llama3 scaling) ->
RMSNorm -> SwiGLU FFN. Head tied to the embedding or separate.
"""

from dataclasses import dataclass

import mlx.nn as nn

from ..core import Attention, Block, RMSNorm, RoPE, SwiGLU, Transformer
from ..errors import UnsupportedArchitectureError
from .config import MAX_LAYERS, flag, normalize_config, number, require, rope_scaling
from .gguf import Metadata, llama_config, unpermute_rows
from .names import NameMap
from .registry import register

# Hugging Face and mlx-lm names (mlx-lm's first where they differ: that is the layout `convert` writes).
# The router and expert names serve the mixture-of-experts families built on this one.
NAMES = NameMap(
    [
        ("model.embed_tokens.", "embed."),
        ("model.layers.{i}.self_attn.", "layers.{i}.attn."),
        ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.ffn.router.score_bias"),
        ("model.layers.{i}.mlp.gate.", "layers.{i}.ffn.router.proj."),
        ("model.layers.{i}.mlp.switch_mlp.", "layers.{i}.ffn.experts."),
        ("model.layers.{i}.mlp.", "layers.{i}.ffn."),
        ("model.layers.{i}.input_layernorm.", "layers.{i}.attn_norm."),
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.ffn_norm."),
        ("model.norm.", "norm."),
        ("lm_head.", "head."),
    ],
    drop=[r"rotary_emb\.inv_freq$"],
)

# llama.cpp's names (`llama`, and the families that share its tensors).
GGUF_NAMES = NameMap(
    [
        ("token_embd.", "embed."),
        ("output_norm.", "norm."),
        ("output.", "head."),
        ("blk.{i}.attn_norm.", "layers.{i}.attn_norm."),
        ("blk.{i}.attn_q_norm.", "layers.{i}.attn.q_norm."),
        ("blk.{i}.attn_k_norm.", "layers.{i}.attn.k_norm."),
        ("blk.{i}.attn_q.", "layers.{i}.attn.q_proj."),
        ("blk.{i}.attn_k.", "layers.{i}.attn.k_proj."),
        ("blk.{i}.attn_v.", "layers.{i}.attn.v_proj."),
        ("blk.{i}.attn_output.", "layers.{i}.attn.o_proj."),
        ("blk.{i}.ffn_norm.", "layers.{i}.ffn_norm."),
        ("blk.{i}.ffn_gate_inp.", "layers.{i}.ffn.router.proj."),
        ("blk.{i}.ffn_gate_exps.", "layers.{i}.ffn.experts.gate_proj."),
        ("blk.{i}.ffn_up_exps.", "layers.{i}.ffn.experts.up_proj."),
        ("blk.{i}.ffn_down_exps.", "layers.{i}.ffn.experts.down_proj."),
        ("blk.{i}.ffn_gate.", "layers.{i}.ffn.gate_proj."),
        ("blk.{i}.ffn_up.", "layers.{i}.ffn.up_proj."),
        ("blk.{i}.ffn_down.", "layers.{i}.ffn.down_proj."),
    ],
    drop=[r"^rope_freqs\."],
)


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
    names = NAMES
    gguf_architectures = ("llama",)
    gguf_names = GGUF_NAMES

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
        dims, heads = number(c, "hidden_size"), number(c, "num_attention_heads")
        kv_heads = number(c, "num_key_value_heads", heads)
        head_dim = number(c, "head_dim", dims // heads)
        require(
            heads % kv_heads == 0,
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})",
        )
        require(head_dim > 0, f"hidden_size ({dims}) is below num_attention_heads ({heads}) and no head_dim is given")
        return cls(
            vocab_size=number(c, "vocab_size"),
            dims=dims,
            layers=number(c, "num_hidden_layers", high=MAX_LAYERS),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_dims=number(c, "intermediate_size"),
            norm_eps=number(c, "rms_norm_eps", 1e-5, float),
            rope_base=number(c, "rope_theta", 10000.0, float),
            rope_scaling=rope_scaling(c),
            max_positions=number(c, "max_position_embeddings", 2048),
            attention_bias=flag(c, "attention_bias"),
            mlp_bias=flag(c, "mlp_bias"),
            tied_head=flag(c, "tie_word_embeddings"),
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
        """Hugging Face or mlx-lm tensors -> the model's (a tied model's stray lm_head is dropped)."""
        weights = self.names.to_ours(weights)
        return {k: v for k, v in weights.items() if not (self.tied_head and k.startswith("head."))}

    def export_weights(self, weights: dict) -> dict:
        """The model's tensors under the names mlx-lm reads (what `minimlx convert` writes)."""
        return self.names.to_theirs(weights)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's `llama` files: LLaMA, Mistral, and (with experts) Mixtral."""
        m = Metadata(metadata)
        config = llama_config(metadata, tensors, "llama")
        if m.get("expert_count"):
            config.update(num_local_experts=m["expert_count"], num_experts_per_tok=m["expert_used_count"])
            config["model_type"] = "mixtral"
        if m.get("rope.dimension_count", config["head_dim"]) != config["head_dim"]:
            raise UnsupportedArchitectureError("GGUF files with partial rotary embeddings are not supported yet")
        return config

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's names -> the model's, with the q/k rows back in rotate-half order."""
        weights = self.gguf_names.to_ours(tensors)
        for name, w in weights.items():
            if ".attn.q_proj." in name or ".attn.k_proj." in name:
                weights[name] = unpermute_rows(w, self.heads if ".q_proj." in name else self.kv_heads)
        return weights
