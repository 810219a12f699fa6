"""Phi-3 (and Phi-3.5, Phi-4-mini): Mistral's block (a sliding window) with fused projections and partial rotary
embeddings.

Checkpoints store q, k and v as one `qkv_proj` and the FFN's gate and up as one `gate_up_proj`; they are
split at load and fused again when written. `partial_rotary_factor` rotates only the first part of each
head.

llama.cpp's `phi3` files keep the fused projections (`attn_qkv`, and `ffn_up` for gate_up) and say how much of each
head turns in `rope.dimension_count`; a `sliding_window` of 0 means none (Phi-4). LongRoPE files (Phi-3 128k, with
`rope_factors_long`) are refused.
"""

from dataclasses import dataclass

from ..errors import UnsupportedArchitectureError
from .gguf import Metadata, llama_config, partial_rotary
from .llama3 import Llama3Config
from .mistral import MistralConfig
from .names import FUSED_GATE_UP_GGUF_NAMES, FUSED_QKV_GGUF_NAMES, LLAMA_GGUF_NAMES
from .registry import register


@register("phi3")
@dataclass
class Phi3Config(MistralConfig):
    example_config = {**Llama3Config.example_config, "model_type": "phi3", "partial_rotary_factor": 0.5}
    fused = ("qkv_proj", "gate_up_proj")
    gguf_architectures = ("phi3",)
    gguf_names = LLAMA_GGUF_NAMES.extended(FUSED_QKV_GGUF_NAMES + FUSED_GATE_UP_GGUF_NAMES)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        if "rope_factors_long.weight" in tensors:
            raise UnsupportedArchitectureError(
                "GGUF files with LongRoPE factors (rope_factors_long: Phi-3 128k) are not supported yet; "
                "use a 4k-context Phi-3 file or the model's Hugging Face folder"
            )
        m = Metadata(metadata)
        config = partial_rotary(m, llama_config(metadata, tensors, "phi3"))
        return {**config, "sliding_window": m.get("attention.sliding_window") or None}
