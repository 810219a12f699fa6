"""Qwen2 / Qwen2.5 and Qwen2-MoE: LLaMA's block with biases on the query, key and value projections.

Qwen2-MoE routes like Qwen3-MoE (softmax router, top `num_experts_per_tok` of `num_experts`, renormalised
when `norm_topk_prob`) and adds one shared SwiGLU expert whose output each token scales by
sigmoid(shared_expert_gate(x)).
"""

from dataclasses import dataclass, replace

import mlx.nn as nn

from ..core import Attention, SwiGLU
from .config import normalize_config, number
from .gguf import Metadata, llama_config
from .llama3 import GGUF_NAMES, NAMES, Llama3Config
from .mistral import windowed
from .qwen3 import Qwen3MoeConfig
from .registry import register


@register("qwen2")
@dataclass
class Qwen2Config(Llama3Config):
    example_config = {**Llama3Config.example_config, "model_type": "qwen2"}
    gguf_architectures = ("qwen2",)

    @classmethod
    def from_config(cls, config: dict):
        c = windowed(normalize_config(config))
        c.setdefault("rms_norm_eps", 1e-6)
        return super().from_config(c)

    def attention(self) -> Attention:
        return Attention(self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), qkv_bias=True)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return llama_config(metadata, tensors, "qwen2")

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's names -> the model's (its converter keeps Qwen's q/k rows in rotate-half order)."""
        return self.gguf_names.to_ours(tensors)


@register("qwen2_moe")
@dataclass
class Qwen2MoeConfig(Qwen3MoeConfig):
    example_config = {
        **Qwen3MoeConfig.example_config,
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": 48,
    }
    gguf_architectures = ("qwen2moe",)
    names = NAMES.extended(
        [
            ("model.layers.{i}.mlp.shared_expert_gate.", "layers.{i}.ffn.shared_gate."),
            ("model.layers.{i}.mlp.shared_expert.", "layers.{i}.ffn.shared_experts."),
        ]
    )
    gguf_names = GGUF_NAMES.extended(
        [
            ("blk.{i}.ffn_gate_inp_shexp.", "layers.{i}.ffn.shared_gate."),
            ("blk.{i}.ffn_gate_shexp.", "layers.{i}.ffn.shared_experts.gate_proj."),
            ("blk.{i}.ffn_up_shexp.", "layers.{i}.ffn.shared_experts.up_proj."),
            ("blk.{i}.ffn_down_shexp.", "layers.{i}.ffn.shared_experts.down_proj."),
        ]
    )
    attention = Qwen2Config.attention  # Qwen2's biases, no q/k norm

    shared_ffn_dims: int = 0

    @classmethod
    def from_config(cls, config: dict):
        c = windowed(normalize_config(config))
        return replace(super().from_config(c), shared_ffn_dims=number(c, "shared_expert_intermediate_size", 0, low=0))

    def shared_expert(self) -> tuple:
        if not self.shared_ffn_dims:
            return ()
        return SwiGLU(self.dims, self.shared_ffn_dims), nn.Linear(self.dims, 1, bias=False)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        return {
            **super().gguf_config(metadata, tensors),
            "model_type": "qwen2_moe",
            "shared_expert_intermediate_size": m.get("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": False,  # llama.cpp's qwen2moe graph never renormalises
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp keeps the shared expert's gate as a vector; the model's is a (1, dims) linear map."""
        weights = super().convert_gguf_weights(tensors, metadata)
        return {k: v.reshape(1, -1) if k.endswith("shared_gate.weight") else v for k, v in weights.items()}
