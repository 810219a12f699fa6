"""Mistral and Mixtral: LLaMA's block, with a sliding attention window, and (Mixtral) a mixture of experts.

Mixtral swaps every FFN for eight SwiGLU experts (`w1` gate, `w3` up, `w2` down) of which a softmax
router picks two per token, their weights renormalised to sum to 1.

Sliding-window attention lets each token see only itself and the `sliding_window - 1` tokens before it;
each layer's cache keeps just those, so its memory stops growing at the window.
"""

from dataclasses import dataclass, replace

import mlx.nn as nn

from ..core import Attention, Experts, MoE, Router
from .config import flag, normalize_config, number, require
from .experts import stack_experts
from .llama3 import NAMES, Llama3Config
from .registry import register

EXPERT_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def sliding_window(config: dict) -> int | None:
    """The config's sliding attention window; None when null, 0 (as Qwen2-MoE writes) or `use_sliding_window: false`."""
    window = number(config, "sliding_window", None, low=0)
    return window if window and flag(config, "use_sliding_window", True) else None


def windowed(config: dict) -> dict:
    """The config with its context cut to its sliding attention window, when the window is shorter: for a text no
    longer than the window, windowed attention is ordinary causal attention (Qwen2, whose window covers only
    some layers: exact up to the window, refused beyond it)."""
    window = sliding_window(config)
    if window and window < number(config, "max_position_embeddings", 2048):
        return {**config, "max_position_embeddings": window}
    return config


@register("mistral")
@dataclass
class MistralConfig(Llama3Config):
    example_config = {**Llama3Config.example_config, "model_type": "mistral", "sliding_window": 16}
    gguf_architectures = ()  # llama.cpp writes Mistral files as `llama`

    window: int | None = None

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        return replace(super().from_config(c), window=sliding_window(c))

    def attention(self) -> Attention:
        bias = self.attention_bias
        return Attention(
            self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), bias, bias, window=self.window
        )


@register("mixtral")
@dataclass
class MixtralConfig(MistralConfig):
    example_config = {**MistralConfig.example_config, "model_type": "mixtral", "num_local_experts": 4}
    names = NAMES.extended(
        [
            ("model.layers.{i}.block_sparse_moe.gate.", "layers.{i}.ffn.router.proj."),
            ("model.layers.{i}.block_sparse_moe.switch_mlp.", "layers.{i}.ffn.experts."),
            ("model.layers.{i}.block_sparse_moe.experts.", "layers.{i}.ffn.experts."),
        ]
    )

    num_experts: int = 8
    experts_per_token: int = 2

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        experts, chosen = number(c, "num_local_experts", 8), number(c, "num_experts_per_tok", 2)
        require(chosen <= experts, f"num_experts_per_tok ({chosen}) must be at most num_local_experts ({experts})")
        return replace(super().from_config(c), num_experts=experts, experts_per_token=chosen)

    def ffn(self, layer: int) -> nn.Module:
        router = Router(self.dims, self.num_experts, self.experts_per_token, "softmax", normalize=True)
        return MoE(router, Experts(self.dims, self.ffn_dims, self.num_experts))

    def convert_weights(self, weights: dict) -> dict:
        renamed = {}
        for name, w in weights.items():
            for theirs, ours in EXPERT_NAMES.items():
                name = name.replace(theirs, ours) if ".experts." in name else name
            renamed[name] = w
        return stack_experts(super().convert_weights(renamed))
