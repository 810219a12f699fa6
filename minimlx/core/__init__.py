"""MLX building blocks of decoder-only transformers. No architecture is named here."""

from .attention import Attention, SharedKVAttention, capped_attention, soft_cap
from .block import Block, FourNormBlock, LayerInputBlock, PostNormBlock
from .cache import (
    ChunkedKVCache,
    IndexedLatentCache,
    KVCache,
    LatentCache,
    QuantizedKVCache,
    RecurrentCache,
    RotatingKVCache,
    SharedKVCache,
)
from .ffn import MLP, GatedFFN, SwiGLU
from .latent_attention import LatentAttention
from .layer_inputs import PerLayerInputs
from .moe import Experts, MoE, Router, clamped_swiglu, is_moe_layer
from .norms import LayerNorm, OffsetRMSNorm, RMSNorm, UnscaledRMSNorm
from .positions import Positions
from .recorder import Recorder
from .recurrent import (
    CausalConv,
    GatedDeltaNet,
    GatedRMSNorm,
    GatedShortConv,
    RecurrentLayer,
    SelectiveStateSpace,
    causal_conv,
    decayed_scan_chunked,
    decayed_scan_recurrent,
    gated_delta_chunked,
    gated_delta_recurrent,
)
from .rope import RoPE
from .sparse_attention import Indexer
from .temperature import QueryTemperature
from .transformer import Transformer

__all__ = [
    "Attention",
    "Block",
    "CausalConv",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "GatedShortConv",
    "RecurrentLayer",
    "SelectiveStateSpace",
    "decayed_scan_chunked",
    "decayed_scan_recurrent",
    "RecurrentCache",
    "causal_conv",
    "gated_delta_chunked",
    "gated_delta_recurrent",
    "ChunkedKVCache",
    "Experts",
    "FourNormBlock",
    "GatedFFN",
    "Indexer",
    "IndexedLatentCache",
    "KVCache",
    "QuantizedKVCache",
    "LatentAttention",
    "LayerInputBlock",
    "PerLayerInputs",
    "SharedKVAttention",
    "SharedKVCache",
    "LatentCache",
    "LayerNorm",
    "MLP",
    "MoE",
    "OffsetRMSNorm",
    "Positions",
    "QueryTemperature",
    "PostNormBlock",
    "RMSNorm",
    "Recorder",
    "RoPE",
    "RotatingKVCache",
    "Router",
    "SwiGLU",
    "Transformer",
    "UnscaledRMSNorm",
    "capped_attention",
    "clamped_swiglu",
    "is_moe_layer",
    "soft_cap",
]
