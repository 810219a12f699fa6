"""GLM-4 (GLM-4-0414: GLM-4-9B, GLM-4-32B, GLM-Z1): Phi-3's fused FFN and partial rotary embeddings, with
four norms a block.

Blocks: RMSNorm -> attention (biases on q, k and v only) -> RMSNorm, added; RMSNorm -> SwiGLU FFN -> RMSNorm,
added. RoPE turns adjacent feature pairs (x0, x1), (x2, x3)... of the first `partial_rotary_factor` of each
head (transformers' interleaved layout). The FFN's gate and up are stored as one `gate_up_proj`, split at load.
"""

from dataclasses import dataclass

from ..core import Attention, FourNormBlock, RMSNorm, RoPE
from .config import normalize_config
from .llama3 import NAMES
from .phi3 import Phi3Config
from .registry import register


@register("glm4")
@dataclass
class Glm4Config(Phi3Config):
    example_config = {**Phi3Config.example_config, "model_type": "glm4"}
    names = NAMES.extended(
        [
            ("model.layers.{i}.post_self_attn_layernorm.", "layers.{i}.post_attn_norm."),
            ("model.layers.{i}.post_mlp_layernorm.", "layers.{i}.post_ffn_norm."),
        ]
    )
    # transformers' defaults for keys that published configs may leave out
    defaults = {"partial_rotary_factor": 0.5, "attention_bias": True}

    @classmethod
    def from_config(cls, config: dict):
        return super().from_config({**cls.defaults, **normalize_config(config)})

    def rope(self) -> RoPE:
        return RoPE(self.rotary_dims, self.rope_base, self.rope_scaling, self.max_positions, traditional=True)

    def attention(self) -> Attention:
        return Attention(self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), qkv_bias=self.attention_bias)

    def block(self, layer: int) -> FourNormBlock:
        norms = [RMSNorm(self.dims, self.norm_eps) for _ in range(4)]
        return FourNormBlock(self.attention(), self.ffn(layer), *norms)

    def fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        return {"gate_up_proj": super().fused_parts()["gate_up_proj"]}
