"""GPT-2: learned position embeddings, LayerNorm, multi-head attention, a GELU MLP, tied head."""

from dataclasses import dataclass

import mlx.nn as nn

from ..core import MLP, Attention, Block, LayerNorm, Transformer
from ..core.ffn import ACTIVATIONS
from ..errors import UnsupportedArchitectureError
from .config import MAX_LAYERS, choice, number, require
from .fused import fuse, split_fused
from .gguf import Metadata
from .names import LLAMA_GGUF_NAMES, NameMap
from .registry import register

# mlx-lm's names; Hugging Face's are the same without `model.` (or with `transformer.` instead).
NAMES = NameMap(
    [
        ("model.wte.", "embed."),
        ("model.wpe.", "positions."),
        ("model.h.{i}.ln_1.", "layers.{i}.attn_norm."),
        ("model.h.{i}.ln_2.", "layers.{i}.ffn_norm."),
        ("model.h.{i}.attn.c_attn.", "layers.{i}.attn.qkv_proj."),
        ("model.h.{i}.attn.c_proj.", "layers.{i}.attn.o_proj."),
        ("model.h.{i}.mlp.c_fc.", "layers.{i}.ffn.up_proj."),
        ("model.h.{i}.mlp.c_proj.", "layers.{i}.ffn.down_proj."),
        ("model.ln_f.", "norm."),
    ],
    drop=[r"\.attn\.(masked_)?bias$", r"lm_head\."],
)
CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # stored (in, out) by Hugging Face
QKV = ("q_proj", "k_proj", "v_proj")
# llama.cpp's names: LLaMA's, plus learned positions and the fused q/k/v (rows q, k, v, as in mlx-lm's c_attn).
GGUF_NAMES = LLAMA_GGUF_NAMES.extended(
    [("position_embd.", "positions."), ("blk.{i}.attn_qkv.", "layers.{i}.attn.qkv_proj.")]
)


@register("gpt2")
@dataclass
class GPT2Config:
    # A tiny model of this family in config.json form; `minimlx archs` builds it (lazily) to list the parts.
    example_config = {
        "model_type": "gpt2",
        "vocab_size": 64,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 32,
    }
    gguf_architectures = ("gpt2",)

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
        dims, heads = number(config, "n_embd", 768), number(config, "n_head", 12)
        require(dims % heads == 0, f"n_embd ({dims}) must be a multiple of n_head ({heads})")
        return cls(
            vocab_size=number(config, "vocab_size", 50257),
            dims=dims,
            layers=number(config, "n_layer", 12, high=MAX_LAYERS),
            heads=heads,
            max_positions=number(config, "n_positions", None) or number(config, "n_ctx", 1024),
            ffn_dims=number(config, "n_inner", None),
            norm_eps=number(config, "layer_norm_epsilon", 1e-5, float),
            activation=choice(config, "activation_function", "gelu_new", ACTIVATIONS),
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
        """Hugging Face (Conv1D weights transposed) or mlx-lm tensors -> the model's; q, k, v split apart."""
        out = {}
        for name, w in weights.items():
            if not name.startswith("model."):
                name = "model." + name.removeprefix("transformer.")
                w = w.T if name.endswith(CONV1D) and w.ndim == 2 else w
            out[name] = w
        return split_fused(NAMES.to_ours(out), "qkv_proj", self.qkv_rows())

    def export_weights(self, weights: dict) -> dict:
        """The model's tensors in mlx-lm's layout: q, k, v fused back into `c_attn`, (out, in) weights."""
        return NAMES.to_theirs(fuse(weights, "qkv_proj", list(QKV)))

    def export_config(self, config: dict) -> dict:
        """The config.json written with `export_weights`' tensors: the checkpoint's."""
        return config

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        if "output.weight" in tensors:
            raise UnsupportedArchitectureError(
                "GPT-2 GGUF files with an output matrix of their own (untied head) are not supported"
            )
        m = Metadata(metadata)
        return {
            "model_type": "gpt2",
            "vocab_size": tensors["token_embd.weight"].shape[0],
            "n_embd": m["embedding_length"],
            "n_layer": m["block_count"],
            "n_head": m["attention.head_count"],
            "n_positions": tensors["position_embd.weight"].shape[0],
            "n_inner": m["feed_forward_length"],
            "layer_norm_epsilon": m.get("attention.layer_norm_epsilon", 1e-5),
            "activation_function": "gelu_new",  # llama.cpp's GELU is the tanh approximation
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's names -> the model's; the fused q/k/v rows (weight, packed or not, and bias) split apart."""
        return split_fused(GGUF_NAMES.to_ours(tensors), "qkv_proj", self.qkv_rows())

    def qkv_rows(self) -> list[tuple[str, int]]:
        """The fused projection's parts: q, k and v, `dims` rows each."""
        return [(proj, self.dims) for proj in QKV]
