"""Llama 4 (`llama4_text`, and the text model of the image-text `llama4` checkpoints: Scout, Maverick).

Blocks: RMSNorm -> grouped-query attention -> RMSNorm -> a SwiGLU FFN (`intermediate_size_mlp` wide) or, in the
layers `moe_layers` lists (each `interleave_moe_layer_step`-th), a mixture of experts. Attention comes in two kinds:
- three layers in four rotate queries and keys (adjacent pairs), then normalise each head to unit root mean square
  (no weight), and attend within chunks of `attention_chunk_size` tokens (a token sees those before it in its own
  chunk; the cache keeps at most one chunk);
- the others (`no_rope_layers` 0) use no RoPE, see the whole text, and scale queries up with their position
  (`attn_temperature_tuning`: 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))).
The router picks the top `num_experts_per_tok` experts by logit; each reads the token times sigmoid(its logit)
(`intermediate_size` wide), and a shared expert of the same width reads every token.

Checkpoints store each layer's experts fused and transposed, `experts.gate_up_proj` as (experts, dims, 2 * hidden)
and `experts.down_proj` as (experts, hidden, dims).

llama.cpp's `llama4` files hold LLaMA's keys and the expert sizes, not the chunk, the temperature or the layers
without RoPE: llama.cpp takes Scout's and Maverick's (chunks of 8192 in three layers of four, floor_scale 8192,
attn_scale 0.1), unless `attention.sliding_window` is 0 (every layer rotated, whole text).
"""

import re
from dataclasses import dataclass, replace

from ..core import UnscaledRMSNorm
from .config import flag, number, require
from .decoder import DecoderConfig
from .experts import ExpertsLayout, MoEConfig
from .gguf import Metadata, llama_config
from .image_text import ImageText, text_model_names
from .names import LLAMA_NAMES
from .registry import register

NAMES = LLAMA_NAMES.extended(
    [
        ("model.layers.{i}.feed_forward.router.", "layers.{i}.ffn.router.proj."),
        ("model.layers.{i}.feed_forward.shared_expert.", "layers.{i}.ffn.shared_experts."),
        ("model.layers.{i}.feed_forward.", "layers.{i}.ffn."),
    ]
)
LLAMACPP_CHUNK = 8192  # llama.cpp's chunk and temperature floor for every `llama4` file
TRANSPOSED_EXPERTS = re.compile(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$")


@register("llama4_text")
@dataclass
class Llama4TextConfig(DecoderConfig):
    example_config = {
        "model_type": "llama4_text",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 16,
        "intermediate_size_mlp": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 4,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 4,
    }
    names = NAMES
    # transformers' Llama4TextExperts keeps them so too, unflagged: PEFT reads their axes the other way round
    experts_layout = ExpertsLayout(transposed=True, flagged=False)
    defaults = {
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "head_dim": 128,
        "attention_chunk_size": 8192,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    }

    gguf_architectures = ("llama4",)

    interleaved_rope: bool = True
    qk_norm_after_rope: bool = True
    qk_norm_class: type = UnscaledRMSNorm

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}
        arch = super().from_config(c)
        layers = arch.layers
        interval = number(c, "no_rope_layer_interval", 4)
        rotated = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        require(
            isinstance(rotated, list) and len(rotated) >= layers and set(rotated) <= {0, 1},
            f"no_rope_layers must list a 0 or 1 for each of the {layers} layers",
        )
        unrotated = tuple(i for i in range(layers) if not rotated[i])
        chunk = number(c, "attention_chunk_size", None)
        kinds = c.get("layer_types")
        if kinds is not None:
            require(
                isinstance(kinds, list)
                and len(kinds) == layers
                and set(kinds) <= {"chunked_attention", "full_attention"},
                f"layer_types must list 'chunked_attention' or 'full_attention' for each of the {layers} layers",
            )
            whole = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
        else:
            whole = unrotated
        temperature = None
        if flag(c, "attn_temperature_tuning", True):
            temperature = (number(c, "attn_scale", kind=float), number(c, "floor_scale", kind=float), 1)
        return replace(
            arch,
            ffn_dims=number(c, "intermediate_size_mlp", arch.ffn_dims),
            unrotated_layers=unrotated,
            chunk=chunk,
            global_layers=whole if chunk else (),
            qk_norm=flag(c, "use_qk_norm", True),
            query_temperature=temperature,
            temperature_layers=unrotated,
            moe=llama4_experts(c, layers),
        )

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """Maverick's 128 experts run without the query and key norms, as llama.cpp decides by the expert count."""
        m = Metadata(metadata)
        config = llama_config(metadata, tensors, "llama4_text")
        layers, experts = config["num_hidden_layers"], m["expert_count"]
        chunked = m.get("attention.sliding_window") != 0
        # the chunked (rotated) layers: a flag per layer, or all but every n-th
        pattern = m.get("attention.sliding_window_pattern", 4) if chunked else [1] * layers
        rotated = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
        return {
            **config,
            "intermediate_size": m["expert_feed_forward_length"],
            "intermediate_size_mlp": config["intermediate_size"],
            "num_local_experts": experts,
            "num_experts_per_tok": m["expert_used_count"],
            "interleave_moe_layer_step": m["interleave_moe_layer_step"],
            "no_rope_layers": [int(bool(r)) for r in rotated],
            "attention_chunk_size": LLAMACPP_CHUNK if chunked else None,
            "floor_scale": LLAMACPP_CHUNK,
            "attn_scale": 0.1,
            "attn_temperature_tuning": chunked,
            "use_qk_norm": experts != 128,
        }

    def convert_weights(self, weights: dict) -> dict:
        """The fused experts turned to the (experts, out, in) layout before they are split."""
        stored = self.experts_layout.stored
        weights = {name: stored(w) if TRANSPOSED_EXPERTS.search(name) else w for name, w in weights.items()}
        return super().convert_weights(weights)


def llama4_experts(config: dict, layers: int) -> MoEConfig:
    experts, chosen = number(config, "num_local_experts", 16), number(config, "num_experts_per_tok", 1)
    require(chosen <= experts, f"num_experts_per_tok ({chosen}) must be at most num_local_experts ({experts})")
    hidden = number(config, "intermediate_size")
    step = number(config, "interleave_moe_layer_step", 1)
    listed = config.get("moe_layers")
    moe_layers = listed if listed is not None else list(range(step - 1, layers, step))
    require(isinstance(moe_layers, list), "moe_layers must list layer numbers")
    dense = tuple(i for i in range(layers) if i not in moe_layers)
    return MoEConfig(
        experts, chosen, hidden, "sigmoid", shared_ffn_dims=hidden, dense_layers=dense, weighted_inputs=True
    )


@register("llama4")
@dataclass
class Llama4Config(ImageText, Llama4TextConfig):
    """The text model of Llama 4's image-text checkpoints."""

    example_config = {"model_type": "llama4", "text_config": Llama4TextConfig.example_config}
    names = text_model_names(NAMES)
    image_text_type = "llama4"
