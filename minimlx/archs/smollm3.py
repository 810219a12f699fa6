"""SmolLM3: LLaMA's block, with RoPE left out of every `no_rope_layer_interval`-th layer.

`no_rope_layers[i]` is 1 where layer i rotates queries and keys and 0 where it attends without any
position signal (the causal mask alone orders the tokens there).
"""

from dataclasses import dataclass, replace

from ..core import Block
from .config import normalize_config, number, require
from .llama3 import Llama3Config
from .registry import register


@register("smollm3")
@dataclass
class SmolLM3Config(Llama3Config):
    example_config = {**Llama3Config.example_config, "model_type": "smollm3", "no_rope_layers": [1, 0]}
    gguf_architectures = ()  # llama.cpp's smollm3 files are not read yet

    rope_layers: tuple = ()

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        arch = super().from_config(c)
        interval = number(c, "no_rope_layer_interval", 4)
        rope_layers = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(arch.layers)]
        require(
            isinstance(rope_layers, list) and len(rope_layers) == arch.layers,
            f"no_rope_layers must list a 0 or 1 for each of the {arch.layers} layers",
        )
        return replace(arch, rope_layers=tuple(bool(r) for r in rope_layers))

    def block(self, layer: int) -> Block:
        block = super().block(layer)
        if not self.rope_layers[layer]:
            block.attn.rope = None
        return block
