"""SmolLM3: LLaMA's block, with RoPE left out of every `no_rope_layer_interval`-th layer.

`no_rope_layers[i]` is 1 where layer i rotates queries and keys and 0 where it attends without any
position signal (the causal mask alone orders the tokens there).
"""

from dataclasses import dataclass, replace

from .config import number, require
from .decoder import DecoderConfig
from .llama3 import Llama3Config
from .registry import register


@register("smollm3")
@dataclass
class SmolLM3Config(DecoderConfig):
    example_config = {**Llama3Config.example_config, "model_type": "smollm3", "no_rope_layers": [1, 0]}

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
