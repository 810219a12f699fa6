"""OLMo-2 (`model_type: olmo2`) for minimlx, registered from outside the framework.

OLMo-2 is LLaMA's block with its norms moved: each RMSNorm reads what a sub-layer is about to add
to the residual stream, x + norm(attn(x)), instead of the stream itself, and queries and keys are
RMS-normalised over the whole projection (all heads at once) before RoPE. Its config keys, RoPE,
SwiGLU FFN and most tensor names are LLaMA's, so this recipe extends minimlx's LLaMA-3 one.
"""

from dataclasses import dataclass

from minimlx import register
from minimlx.archs.llama3 import NAMES, Llama3Config
from minimlx.core import Attention, PostNormBlock, RMSNorm

# The two checkpoint names whose meaning differs from LLaMA's; LLaMA's map covers all the others.
NORMS_AFTER_SUBLAYERS = NAMES.extended(
    [
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.attn_norm."),
        ("model.layers.{i}.post_feedforward_layernorm.", "layers.{i}.ffn_norm."),
    ]
)


@register("olmo2")
@dataclass
class Olmo2Config(Llama3Config):
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
    gguf_architectures = ()  # llama.cpp's olmo2 files are not read by this plugin

    def attention(self) -> Attention:
        """LLaMA's attention with one RMSNorm over all query heads together and one over all key heads."""
        bias = self.attention_bias
        return Attention(
            self.dims,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.rope(),
            bias,
            bias,
            qk_norm_eps=self.norm_eps,
            qk_norm_per_head=False,
        )

    def block(self, layer: int) -> PostNormBlock:
        """Norms after the sub-layers: x + attn_norm(attn(x)), then + ffn_norm(ffn(.))."""
        return PostNormBlock(
            self.attention(), self.ffn(layer), RMSNorm(self.dims, self.norm_eps), RMSNorm(self.dims, self.norm_eps)
        )
