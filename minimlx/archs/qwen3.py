"""Qwen3: LLaMA's block with an RMSNorm on each query and key head before RoPE."""

from dataclasses import dataclass

from ..core import Attention
from ..io.config import normalize_config
from .llama3 import Llama3Config
from .registry import register


@register("qwen3")
@dataclass
class Qwen3Config(Llama3Config):
    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        c.setdefault("rms_norm_eps", 1e-6)
        c.setdefault("rope_theta", 1000000.0)
        return super().from_config(c)

    def attention(self) -> Attention:
        bias = self.attention_bias
        return Attention(
            self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), bias, bias, qk_norm_eps=self.norm_eps
        )
