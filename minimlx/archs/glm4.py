"""GLM-4 (GLM-4-0414: GLM-4-9B, GLM-4-32B, GLM-Z1): partial rotary embeddings, interleaved, and four norms a block.

Blocks: RMSNorm -> attention (biases on q, k and v only) -> RMSNorm, added; RMSNorm -> SwiGLU FFN -> RMSNorm,
added. RoPE turns adjacent feature pairs (x0, x1), (x2, x3)... of the first `partial_rotary_factor` of each
head (transformers' interleaved layout). The FFN's gate and up are stored as one `gate_up_proj`, split at load
(llama.cpp's `glm4` files call it `ffn_up`, and keep q and k rows as stored).

GLM-4.5, 4.6 and 4.7 (`glm4_moe`) are another recipe: see `Glm4MoeConfig`.
"""

from dataclasses import dataclass, replace

from .config import flag
from .decoder import DecoderConfig
from .deepseek import deepseek_experts
from .gguf import Metadata, llama_config, moe_config, partial_rotary
from .names import (
    FUSED_GATE_UP_GGUF_NAMES,
    GGUF_LAYER_INDEX,
    LLAMA_GGUF_NAMES,
    LLAMA_NAMES,
    POST_NORM_GGUF_NAMES,
    within_stack,
)
from .phi3 import Phi3Config
from .registry import register


@register("glm4")
@dataclass
class Glm4Config(DecoderConfig):
    example_config = {**Phi3Config.example_config, "model_type": "glm4"}
    names = LLAMA_NAMES.extended(
        [
            ("model.layers.{i}.post_self_attn_layernorm.", "layers.{i}.post_attn_norm."),
            ("model.layers.{i}.post_mlp_layernorm.", "layers.{i}.post_ffn_norm."),
        ]
    )
    gguf_architectures = ("glm4",)
    gguf_names = LLAMA_GGUF_NAMES.extended(POST_NORM_GGUF_NAMES + FUSED_GATE_UP_GGUF_NAMES)
    defaults = {"partial_rotary_factor": 0.5, "attention_bias": True}
    fused = ("gate_up_proj",)

    norms: str = "both"
    interleaved_rope: bool = True

    @classmethod
    def from_config(cls, config: dict):
        """`attention_bias` covers q, k and v, not the output projection."""
        return replace(super().from_config(config), out_bias=False)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return partial_rotary(Metadata(metadata), llama_config(metadata, tensors, "glm4"))


@register("glm4_moe")
@dataclass
class Glm4MoeConfig(DecoderConfig):
    """GLM-4.5, 4.6 and 4.7: LLaMA's pre-norm block with RoPE on the first half of each head (rotate-half pairs),
    biases on q, k and v, an optional norm on each query and key head (`use_qk_norm`), and from
    `first_k_dense_replace` on DeepSeek-V3's mixture of experts: sigmoid scores plus a correction bias choose the
    groups and experts, the chosen weights renormalised and scaled by `routed_scaling_factor`, shared experts beside.
    The multi-token-prediction layer stored past `num_hidden_layers` is not loaded."""

    example_config = {
        **Phi3Config.example_config,
        "model_type": "glm4_moe",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    defaults = {
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
    }
    gguf_architectures = ("glm4moe",)
    # llama.cpp's `glm4moe` names the FFN's input norm after the attention, as transformers does
    gguf_names = LLAMA_GGUF_NAMES.extended([("blk.{i}.post_attention_norm.", "layers.{i}.ffn_norm.")])

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}
        return replace(
            super().from_config(c),
            out_bias=False,
            qk_norm=flag(c, "use_qk_norm"),
            moe=deepseek_experts({**c, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
        )

    def convert_weights(self, weights: dict) -> dict:
        return super().convert_weights(within_stack(weights, self.layers))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """LLaMA's keys, the rotated share of each head, and DeepSeek's expert keys; the multi-token-prediction
        layers llama.cpp counts in `block_count` are left out."""
        m = Metadata(metadata)
        return {
            **partial_rotary(m, llama_config(metadata, tensors, "glm4_moe")),
            **moe_config(m),
            "num_hidden_layers": m["block_count"] - m.get("nextn_predict_layers", 0),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        return super().convert_gguf_weights(within_stack(tensors, self.layers, GGUF_LAYER_INDEX), metadata)
