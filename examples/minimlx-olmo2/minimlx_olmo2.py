"""OLMo-2 (`model_type: olmo2`) for minimlx, registered from outside the framework.

OLMo-2 is LLaMA's block with its norms moved: each RMSNorm reads what a sub-layer is about to add
to the residual stream, x + norm(attn(x)), instead of the stream itself, and queries and keys are
RMS-normalised over the whole projection (all heads at once) before RoPE. Its config keys, RoPE,
SwiGLU FFN and most tensor names are LLaMA's, so the recipe is minimlx's decoder with three settings changed.
"""

from dataclasses import dataclass

from minimlx import register
from minimlx.archs.decoder import DecoderConfig
from minimlx.archs.names import LLAMA_NAMES

# The two checkpoint names whose meaning differs from LLaMA's; LLaMA's map covers all the others.
NORMS_AFTER_SUBLAYERS = LLAMA_NAMES.extended(
    [
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.attn_norm."),
        ("model.layers.{i}.post_feedforward_layernorm.", "layers.{i}.ffn_norm."),
    ]
)


@register("olmo2")
@dataclass
class Olmo2Config(DecoderConfig):
    # A tiny OLMo-2 in config.json form: `minimlx archs` builds it to list the parts, the tests check it.
    example_config = {
        "model_type": "olmo2",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    names = NORMS_AFTER_SUBLAYERS

    norms: str = "after"  # x + attn_norm(attn(x)), then + ffn_norm(ffn(.))
    qk_norm: bool = True  # one RMSNorm over all query heads together, one over all key heads
    qk_norm_per_head: bool = False
