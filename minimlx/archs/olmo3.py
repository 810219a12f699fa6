"""OLMo-3 (`model_type: olmo3`, AI2's 2025 models): OLMo-2's block with sliding-window layers.

Blocks: attention -> RMSNorm, added; SwiGLU FFN -> RMSNorm, added (the norms read what a sub-layer adds, not
the stream). Queries and keys are RMS-normalised over the whole projection (all heads at once) before RoPE.
Three of every four layers attend through a `sliding_window` (`layer_types` says which); the others see the whole
text, with their own RoPE scaling where `rope_parameters` gives one per layer type.

llama.cpp writes OLMo 2 and 3 as `olmo2`: the windowed layers' base in `rope.freq_base_swa`, turned unscaled.
"""

from dataclasses import dataclass, replace

from .config import global_layers, number, rope_scaling
from .decoder import DecoderConfig
from .gguf import Metadata, llama_config, windows
from .llama3 import Llama3Config
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES
from .registry import register

# OLMo's norms sit after the sub-layers: `post_attention_layernorm` is the attention's output norm, not the FFN's input.
NORMS_AFTER_SUBLAYERS = LLAMA_NAMES.extended(
    [
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.attn_norm."),
        ("model.layers.{i}.post_feedforward_layernorm.", "layers.{i}.ffn_norm."),
    ]
)
GGUF_NORMS_AFTER_SUBLAYERS = LLAMA_GGUF_NAMES.extended(
    [
        ("blk.{i}.post_attention_norm.", "layers.{i}.attn_norm."),
        ("blk.{i}.post_ffw_norm.", "layers.{i}.ffn_norm."),
    ]
)


@register("olmo3")
@dataclass
class Olmo3Config(DecoderConfig):
    example_config = {
        **Llama3Config.example_config,
        "model_type": "olmo3",
        "num_hidden_layers": 4,
        "sliding_window": 4,
    }
    names = NORMS_AFTER_SUBLAYERS
    gguf_architectures = ("olmo2",)
    gguf_names = GGUF_NORMS_AFTER_SUBLAYERS
    defaults = {"sliding_window": 4096}

    norms: str = "after"
    qk_norm: bool = True
    qk_norm_per_head: bool = False

    @classmethod
    def from_config(cls, config: dict):
        """A window over every layer but each fourth (or those `layer_types` marks `full_attention`); the windowed
        layers' RoPE is `rope_parameters.sliding_attention`'s, which transformers gives the global base when unset."""
        c = {**cls.defaults, **config}
        arch = super().from_config(c)
        window = number(c, "sliding_window", None)
        return replace(
            arch,
            window=window,
            global_layers=global_layers(c, arch.layers, 4) if window else (),
            local_rope_base=number(c, "rope_local_base_freq", arch.rope_base, float),
            local_rope_scaling=rope_scaling(c, "rope_local_scaling"),
        )

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """LLaMA's keys, the window and the layers it covers (none in OLMo 2's files), the windowed layers' base."""
        m = Metadata(metadata)
        config = {**llama_config(metadata, tensors, "olmo3"), **windows(m, 4)}
        return {**config, "rope_local_base_freq": m.get("rope.freq_base_swa", config["rope_theta"])}
