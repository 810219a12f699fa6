"""Qwen3: LLaMA's block with an RMSNorm on each query and key head before RoPE.

Qwen3-MoE swaps the FFN of every `decoder_sparse_step`-th layer (except `mlp_only_layers`) for a
mixture of experts: softmax router, top `num_experts_per_tok`, optionally renormalised, no shared expert.
"""

from dataclasses import dataclass, replace

from .config import flag, number, require
from .decoder import DecoderConfig
from .experts import MoEConfig
from .gguf import Metadata, llama_config
from .llama3 import Llama3Config
from .registry import register


def qwen_experts(config: dict, shared_ffn_dims: int = 0) -> MoEConfig | None:
    """Qwen's mixture of experts (Qwen2-MoE's adds a shared expert, gated); None where `num_experts` is 0."""
    experts = number(config, "num_experts", None, low=0) or number(config, "num_local_experts", 0, low=0)
    chosen = number(config, "num_experts_per_tok")
    ffn_dims = number(config, "moe_intermediate_size")
    normalize = flag(config, "norm_topk_prob")
    step = number(config, "decoder_sparse_step", 1)
    dense = tuple(config.get("mlp_only_layers") or ())
    require(chosen <= max(experts, 1), f"num_experts_per_tok ({chosen}) must be at most num_experts ({experts})")
    if not experts:
        return None
    return MoEConfig(
        experts,
        chosen,
        ffn_dims,
        normalize=normalize,
        shared_ffn_dims=shared_ffn_dims,
        shared_gate=True,
        every=step,
        phase=step - 1,
        dense_layers=dense,
    )


def gguf_experts(metadata: dict) -> dict:
    """llama.cpp's expert keys as Qwen's config keys."""
    m = Metadata(metadata)
    return {
        "num_experts": m["expert_count"],
        "num_experts_per_tok": m["expert_used_count"],
        "moe_intermediate_size": m["expert_feed_forward_length"],
    }


@register("qwen3")
@dataclass
class Qwen3Config(DecoderConfig):
    example_config = {**Llama3Config.example_config, "model_type": "qwen3"}
    gguf_architectures = ("qwen3",)
    defaults = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0}

    qk_norm: bool = True


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

    @classmethod
    def from_config(cls, config: dict):
        return replace(super().from_config(config), moe=qwen_experts(config))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return {
            **llama_config(metadata, tensors, "qwen3_moe"),
            **gguf_experts(metadata),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises the chosen weights
        }
