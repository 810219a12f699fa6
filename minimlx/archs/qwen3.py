"""Qwen3: LLaMA's block with an RMSNorm on each query and key head before RoPE.

Qwen3-MoE swaps the FFN of every `decoder_sparse_step`-th layer (except `mlp_only_layers`) for a
mixture of experts: softmax router, top `num_experts_per_tok`, optionally renormalised, no shared expert.
"""

from dataclasses import dataclass, replace

import mlx.nn as nn

from ..core import Attention, Experts, MoE, Router, is_moe_layer
from .config import flag, normalize_config, number, require
from .experts import stack_experts
from .gguf import Metadata, llama_config
from .llama3 import Llama3Config
from .registry import register


@register("qwen3")
@dataclass
class Qwen3Config(Llama3Config):
    gguf_architectures = ("qwen3",)

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        c.setdefault("rms_norm_eps", 1e-6)
        c.setdefault("rope_theta", 1000000.0)
        return super().from_config(c)

    def attention(self) -> Attention:
        bias = self.attention_bias
        return Attention(
            self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), bias, bias, qk_norm_eps=self.norm_eps
        )

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return llama_config(metadata, tensors, "qwen3")

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's names -> the model's (its converter keeps Qwen's q/k rows in rotate-half order)."""
        return self.gguf_names.to_ours(tensors)


@register("qwen3_moe")
@dataclass
class Qwen3MoeConfig(Qwen3Config):
    example_config = {
        **Qwen3Config.example_config,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "mlp_only_layers": [0],
    }
    gguf_architectures = ("qwen3moe",)

    num_experts: int = 0
    experts_per_token: int = 1
    moe_ffn_dims: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        arch = replace(
            super().from_config(c),
            num_experts=number(c, "num_experts", None, low=0) or number(c, "num_local_experts", 0, low=0),
            experts_per_token=number(c, "num_experts_per_tok"),
            moe_ffn_dims=number(c, "moe_intermediate_size"),
            norm_topk_prob=flag(c, "norm_topk_prob"),
            decoder_sparse_step=number(c, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
        )
        require(
            arch.experts_per_token <= max(arch.num_experts, 1),
            f"num_experts_per_tok ({arch.experts_per_token}) must be at most num_experts ({arch.num_experts})",
        )
        return arch

    def ffn(self, layer: int) -> nn.Module:
        step = self.decoder_sparse_step
        if self.num_experts == 0 or not is_moe_layer(layer, every=step, phase=step - 1, dense=self.mlp_only_layers):
            return super().ffn(layer)
        router = Router(self.dims, self.num_experts, self.experts_per_token, "softmax", self.norm_topk_prob)
        return MoE(router, Experts(self.dims, self.moe_ffn_dims, self.num_experts), *self.shared_expert())

    def shared_expert(self) -> tuple:
        """The shared expert beside the routed ones, and its gate: none in Qwen3-MoE."""
        return ()

    def convert_weights(self, weights: dict) -> dict:
        return stack_experts(super().convert_weights(weights))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        return {
            **llama_config(metadata, tensors, "qwen3_moe"),
            "num_experts": m["expert_count"],
            "num_experts_per_tok": m["expert_used_count"],
            "moe_intermediate_size": m["expert_feed_forward_length"],
            "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises the chosen weights
        }
