"""Phi-3 (and Phi-3.5, Phi-4-mini): Mistral's block (a sliding window) with fused projections and partial rotary
embeddings.

Checkpoints store q, k and v as one `qkv_proj` and the FFN's gate and up as one `gate_up_proj`; they are
split at load and fused again when written. `partial_rotary_factor` rotates only the first part of each
head.
"""

from dataclasses import dataclass, replace

from ..core import RoPE
from .config import normalize_config, number, require
from .fused import fuse, split_fused
from .llama3 import Llama3Config
from .mistral import MistralConfig
from .registry import register


@register("phi3")
@dataclass
class Phi3Config(MistralConfig):
    example_config = {**Llama3Config.example_config, "model_type": "phi3", "partial_rotary_factor": 0.5}
    gguf_architectures = ()  # llama.cpp's phi3 files are not read yet

    rotary_dims: int = 0

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        arch, factor = super().from_config(c), number(c, "partial_rotary_factor", 1.0, float)
        require(factor <= 1, f"partial_rotary_factor ({factor}) must be at most 1")
        return replace(arch, rotary_dims=int(arch.head_dim * factor))

    def rope(self) -> RoPE:
        return RoPE(self.rotary_dims, self.rope_base, self.rope_scaling, self.max_positions)

    def fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        kv_rows = self.kv_heads * self.head_dim
        return {
            "qkv_proj": [("q_proj", self.heads * self.head_dim), ("k_proj", kv_rows), ("v_proj", kv_rows)],
            "gate_up_proj": [("gate_proj", self.ffn_dims), ("up_proj", self.ffn_dims)],
        }

    def convert_weights(self, weights: dict) -> dict:
        weights = super().convert_weights(weights)
        for fused, parts in self.fused_parts().items():
            weights = split_fused(weights, fused, parts)
        return weights

    def export_weights(self, weights: dict) -> dict:
        for fused, parts in self.fused_parts().items():
            weights = fuse(weights, fused, [part for part, _ in parts])
        return super().export_weights(weights)
