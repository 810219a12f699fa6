"""MLX building blocks of decoder-only transformers. No architecture is named here."""

from .attention import Attention
from .block import Block
from .cache import KVCache
from .ffn import MLP, SwiGLU
from .norms import LayerNorm, RMSNorm
from .recorder import Recorder
from .rope import RoPE
from .transformer import Transformer

__all__ = ["Attention", "Block", "KVCache", "LayerNorm", "MLP", "RMSNorm", "Recorder", "RoPE", "SwiGLU", "Transformer"]
