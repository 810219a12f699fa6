"""Phi-3 (and Phi-3.5, Phi-4-mini): Mistral's block (a sliding window) with fused projections and partial rotary
embeddings.

Checkpoints store q, k and v as one `qkv_proj` and the FFN's gate and up as one `gate_up_proj`; they are
split at load and fused again when written. `partial_rotary_factor` rotates only the first part of each
head.
"""

from dataclasses import dataclass

from .llama3 import Llama3Config
from .mistral import MistralConfig
from .registry import register


@register("phi3")
@dataclass
class Phi3Config(MistralConfig):
    example_config = {**Llama3Config.example_config, "model_type": "phi3", "partial_rotary_factor": 0.5}
    fused = ("qkv_proj", "gate_up_proj")
