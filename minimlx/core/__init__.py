"""MLX building blocks of decoder-only transformers. No architecture is named here."""

from .attention import Attention
from .block import Block, PostNormBlock
from .cache import KVCache, LatentCache
from .ffn import MLP, SwiGLU
from .latent_attention import LatentAttention
from .moe import Experts, MoE, Router, clamped_swiglu, is_moe_layer, stack_experts
from .norms import LayerNorm, RMSNorm
from .recorder import Recorder
from .rope import RoPE
from .transformer import Transformer

__all__ = [
    "Attention", "Block", "Experts", "KVCache", "LatentAttention", "LatentCache", "LayerNorm", "MLP", "MoE",
    "PostNormBlock", "RMSNorm", "Recorder", "RoPE", "Router", "SwiGLU", "Transformer", "clamped_swiglu", "is_moe_layer",
    "stack_experts",
]
