"""Gemma 2 and Gemma 3 (text, and the text part of Gemma 3's image-text checkpoints).

Blocks: (1 + w) RMSNorm -> grouped-query attention -> (1 + w) RMSNorm, added; (1 + w) RMSNorm -> GELU-tanh
gated FFN -> (1 + w) RMSNorm, added (four norms a block). Most layers are local: they attend through a
sliding window (Gemma 2 alternates local and global layers, Gemma 3 has five local to each global one)
and Gemma 3 gives them their own RoPE base. Queries are scaled by 1/sqrt(query_pre_attn_scalar); tokens are
embedded times sqrt(hidden_size); the head is the embedding's transpose. Gemma 2 soft-caps the attention
scores and the logits; Gemma 3 instead norms each query and key head.
"""

from dataclasses import dataclass, replace

import mlx.nn as nn

from ..core import Attention, FourNormBlock, GatedFFN, OffsetRMSNorm, RoPE, Transformer
from ..core.ffn import ACTIVATIONS
from ..errors import UnsupportedArchitectureError
from .config import choice, flag, normalize_config, number, rope_scaling, sliding_layers
from .llama3 import NAMES, Llama3Config
from .names import NameMap
from .registry import register

GEMMA_NAMES = NAMES.extended(
    [
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.post_attn_norm."),
        ("model.layers.{i}.pre_feedforward_layernorm.", "layers.{i}.ffn_norm."),
        ("model.layers.{i}.post_feedforward_layernorm.", "layers.{i}.post_ffn_norm."),
    ]
)


def optional_cap(config: dict, key: str, default: float | None) -> float | None:
    """A soft-capping value: `default` when the key is absent, None (no capping) when it is null."""
    if key not in config:
        return default
    return None if config[key] is None else number(config, key, kind=float)


@register("gemma2")
@dataclass
class Gemma2Config(Llama3Config):
    example_config = {**Llama3Config.example_config, "model_type": "gemma2", "head_dim": 8, "sliding_window": 4}
    names = GEMMA_NAMES
    gguf_architectures = ()  # llama.cpp's gemma2 files are not read yet
    # transformers' defaults for keys that published configs may leave out
    defaults = {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "sliding_window": 4096, "query_pre_attn_scalar": 256}
    global_every = 2  # without layer_types or sliding_window_pattern: every second layer global
    default_caps = (50.0, 30.0)  # attention and final soft-caps, when the config leaves them out

    activation: str = "gelu_pytorch_tanh"
    query_scale: float = 1.0
    window: int | None = None
    sliding: tuple = ()
    local_rope_base: float = 10000.0
    local_rope_scaling: dict | None = None
    attention_cap: float | None = None
    logit_cap: float | None = None
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **normalize_config(config)}
        if flag(c, "use_bidirectional_attention"):
            raise UnsupportedArchitectureError("bidirectional Gemma (use_bidirectional_attention) is not supported")
        arch = super().from_config(c)
        window = number(c, "sliding_window", None)
        return replace(
            arch,
            activation=choice(c, "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS),
            query_scale=number(c, "query_pre_attn_scalar", kind=float) ** -0.5,
            window=window,
            sliding=sliding_layers(c, arch.layers, cls.global_every) if window else (False,) * arch.layers,
            local_rope_base=arch.rope_base,
            local_rope_scaling=arch.rope_scaling,
            attention_cap=optional_cap(c, "attn_logit_softcapping", cls.default_caps[0]),
            logit_cap=optional_cap(c, "final_logit_softcapping", cls.default_caps[1]),
        )

    def norm(self) -> OffsetRMSNorm:
        return OffsetRMSNorm(self.dims, self.norm_eps)

    def block(self, layer: int) -> FourNormBlock:
        local = self.sliding[layer]
        base, scaling = (
            (self.local_rope_base, self.local_rope_scaling) if local else (self.rope_base, self.rope_scaling)
        )
        rope = RoPE(self.head_dim, base, scaling, self.max_positions)
        attn = Attention(
            self.dims,
            self.heads,
            self.kv_heads,
            self.head_dim,
            rope,
            self.attention_bias,
            self.attention_bias,
            qk_norm_eps=self.norm_eps if self.qk_norm else None,
            window=self.window if local else None,
            scale=self.query_scale,
            logit_cap=self.attention_cap,
            qk_norm=OffsetRMSNorm,
        )
        ffn = GatedFFN(self.dims, self.ffn_dims, self.activation, self.mlp_bias)
        return FourNormBlock(attn, ffn, self.norm(), self.norm(), self.norm(), self.norm())

    def build(self) -> Transformer:
        blocks = [self.block(i) for i in range(self.layers)]
        head = None if self.tied_head else nn.Linear(self.dims, self.vocab_size, bias=False)
        embed = nn.Embedding(self.vocab_size, self.dims)
        return Transformer(embed, blocks, self.norm(), head, embed_scale=self.dims**0.5, logit_cap=self.logit_cap)


@register("gemma3_text")
@dataclass
class Gemma3TextConfig(Gemma2Config):
    example_config = {
        **Gemma2Config.example_config,
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "sliding_window_pattern": 3,
    }
    defaults = {
        **Gemma2Config.defaults,
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
    }
    global_every, default_caps = 6, (None, None)  # five local layers to each global one; no soft-caps

    @classmethod
    def from_config(cls, config: dict):
        """Global layers read `rope_parameters["full_attention"]` (transformers 5) or `rope_theta`/`rope_scaling`;
        local ones `rope_parameters["sliding_attention"]` or `rope_local_base_freq`."""
        rope = config.get("rope_parameters") or {}
        by_layer_type = "full_attention" in rope or "sliding_attention" in rope
        global_config = {**config, "rope_parameters": rope.get("full_attention")} if by_layer_type else config
        local = normalize_config(
            {
                "rope_parameters": rope.get("sliding_attention")
                if by_layer_type
                else {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
            }
        )
        arch = super().from_config(global_config)
        return replace(
            arch,
            qk_norm=True,
            local_rope_base=number(local, "rope_theta", 10000.0, float),
            local_rope_scaling=rope_scaling(local),
        )


# Gemma 3's image-text checkpoints: the text model's tensors under `language_model` (transformers 4 and mlx-lm)
# or `model.language_model` (transformers 5), beside the vision tower's, which a text model leaves out.
MULTIMODAL_NAMES = NameMap(
    [
        (prefix + theirs.removeprefix("model."), ours)
        for prefix in ("language_model.model.", "model.language_model.")
        for theirs, ours in GEMMA_NAMES.templates
        if theirs.startswith("model.")
    ]
    + [("language_model.lm_head.", "head."), ("lm_head.", "head.")],
    drop=[*GEMMA_NAMES.drop_patterns, r"(^|\.)vision_tower\.", r"(^|\.)multi_modal_projector\."],
)


@register("gemma3")
@dataclass
class Gemma3Config(Gemma3TextConfig):
    example_config = {"model_type": "gemma3", "text_config": Gemma3TextConfig.example_config}
    names = MULTIMODAL_NAMES

    @classmethod
    def from_config(cls, config: dict):
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedArchitectureError("a gemma3 config needs its text_config; fix the config")
        return super().from_config({"tie_word_embeddings": config.get("tie_word_embeddings", True), **text})
