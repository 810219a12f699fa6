"""SmolLM3: LLaMA's block, with RoPE left out of every `no_rope_layer_interval`-th layer.

`no_rope_layers[i]` is 1 where layer i rotates queries and keys and 0 where it attends without any
position signal (the causal mask alone orders the tokens there). llama.cpp's `smollm3` files do not say which:
llama.cpp leaves RoPE out of every 4th layer, SmolLM3's published interval, and permutes q and k rows as LLaMA's.
"""

from dataclasses import dataclass, replace

from .config import number, require
from .decoder import DecoderConfig
from .gguf import llama_config
from .llama3 import Llama3Config
from .registry import register


@register("smollm3")
@dataclass
class SmolLM3Config(DecoderConfig):
    example_config = {**Llama3Config.example_config, "model_type": "smollm3", "no_rope_layers": [1, 0]}
    gguf_architectures = ("smollm3",)
    gguf_rows_permuted = True

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        interval = number(config, "no_rope_layer_interval", 4)
        rope_layers = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(arch.layers)]
        require(
            isinstance(rope_layers, list) and len(rope_layers) == arch.layers,
            f"no_rope_layers must list a 0 or 1 for each of the {arch.layers} layers",
        )
        return replace(arch, unrotated_layers=tuple(i for i, rotated in enumerate(rope_layers) if not rotated))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return {**llama_config(metadata, tensors, "smollm3"), "no_rope_layer_interval": 4}
