"""GLM-4 (GLM-4-0414: GLM-4-9B, GLM-4-32B, GLM-Z1): partial rotary embeddings, interleaved, and four norms a block.

Blocks: RMSNorm -> attention (biases on q, k and v only) -> RMSNorm, added; RMSNorm -> SwiGLU FFN -> RMSNorm,
added. RoPE turns adjacent feature pairs (x0, x1), (x2, x3)... of the first `partial_rotary_factor` of each
head (transformers' interleaved layout). The FFN's gate and up are stored as one `gate_up_proj`, split at load
(llama.cpp's `glm4` files call it `ffn_up`, and keep q and k rows as stored).
"""

from dataclasses import dataclass, replace

from .decoder import DecoderConfig
from .gguf import Metadata, llama_config, partial_rotary
from .names import FUSED_GATE_UP_GGUF_NAMES, LLAMA_GGUF_NAMES, LLAMA_NAMES, POST_NORM_GGUF_NAMES
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
