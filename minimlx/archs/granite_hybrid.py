"""Granite 4 (`granitemoehybrid`): LLaMA's block where most layers' token-mixer is Mamba2's selective state-space
layer (`layer_types` "mamba", or transformers 5's "linear_attention") and the others attend, with RoPE or none
(`position_embedding_type`). The FFN is a SwiGLU (`shared_mlp`, gate and up fused as `input_linear`) beside a
mixture of experts when `num_local_experts` (softmax over the chosen experts' logits). Scalings: the embedding by
`embedding_multiplier`, attention scores by `attention_multiplier` (not 1/sqrt(head_dim)), each sub-layer's output
by `residual_multiplier`, the logits divided by `logits_scaling`.

mlx-lm's folders hold the dense FFN split (`mlp.gate_proj`, `up_proj`, `down_proj`) and the experts as
`switch_mlp`. llama.cpp's converter (`granitehybrid`) marks the Mamba2 layers by zero key-value heads, turns
attention by RoPE only where `rope.scaling.finetuned` says so (never, for a model with Mamba2 layers), stores A as
-exp(A_log), the convolution as (channels, kernel), the gated norm's weight one row per group, and splits every fused
FFN into gate and up.
"""

from dataclasses import dataclass, replace

import mlx.core as mx

from ..errors import CheckpointError
from .config import flag, number, recurrent_layers, require
from .decoder import DecoderConfig, StateSpaceConfig
from .experts import MoEConfig
from .fused import fuse
from .gguf import Metadata, hybrid_layers, llama_config
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES
from .registry import register

RECURRENT_KINDS, ATTENTION_KINDS = ("mamba", "linear_attention"), ("attention", "full_attention")


def mamba_layers(config: dict, layers: int) -> tuple[int, ...]:
    kinds = config.get("layer_types") or config.get("layers_block_type")
    if kinds is None:
        return tuple(range(layers))
    return recurrent_layers(kinds, layers, RECURRENT_KINDS, ATTENTION_KINDS)


def float_value(value) -> float:
    """A config float, also as transformers writes one JSON cannot hold: {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"config key 'time_step_limit' must hold numbers, got {value!r}; fix the config"
        ) from None


def state_space(config: dict, dims: int, layers: int) -> StateSpaceConfig:
    heads, head_dims = number(config, "mamba_n_heads"), number(config, "mamba_d_head")
    expand = number(config, "mamba_expand", 2)
    require(
        heads * head_dims == expand * dims,
        f"mamba_n_heads * mamba_d_head ({heads} * {head_dims}) must be mamba_expand * hidden_size ({expand} * {dims})",
    )
    groups = number(config, "mamba_n_groups", 1)
    require(heads % groups == 0, f"mamba_n_heads ({heads}) must be a multiple of mamba_n_groups ({groups})")
    limits = config.get("time_step_limit") or (0.0, float("inf"))
    return StateSpaceConfig(
        layers=mamba_layers(config, layers),
        heads=heads,
        head_dims=head_dims,
        state_dims=number(config, "mamba_d_state"),
        groups=groups,
        kernel=number(config, "mamba_d_conv", 4),
        conv_bias=flag(config, "mamba_conv_bias", True),
        bias=flag(config, "mamba_proj_bias"),
        dt_limits=(float_value(limits[0]), float_value(limits[1])),
    )


@register("granitemoehybrid")
@dataclass
class GraniteHybridConfig(DecoderConfig):
    example_config = {
        "model_type": "granitemoehybrid",
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "shared_intermediate_size": 96,
        "num_local_experts": 0,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
    }
    names = LLAMA_NAMES.extended(
        [
            ("model.layers.{i}.mamba.", "layers.{i}.attn."),
            ("model.layers.{i}.shared_mlp.input_linear.", "layers.{i}.shared_mlp.gate_up_proj."),
            ("model.layers.{i}.shared_mlp.output_linear.", "layers.{i}.shared_mlp.down_proj."),
            ("model.layers.{i}.block_sparse_moe.router.layer.", "layers.{i}.ffn.router.proj."),
            ("model.layers.{i}.block_sparse_moe.switch_mlp.", "layers.{i}.ffn.experts."),
            ("model.layers.{i}.block_sparse_moe.input_linear.weight", "layers.{i}.ffn.experts.gate_up_proj"),
            ("model.layers.{i}.block_sparse_moe.output_linear.weight", "layers.{i}.ffn.experts.down_proj"),
        ]
    )
    fused = ("gate_up_proj",)
    defaults = {"intermediate_size": 1, "rms_norm_eps": 1e-6}

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}
        arch = super().from_config(c)
        experts = number(c, "num_local_experts", 0, low=0)
        shared = number(c, "shared_intermediate_size")
        moe = None
        if experts:
            chosen = number(c, "num_experts_per_tok")
            require(chosen <= experts, f"num_experts_per_tok ({chosen}) must be at most num_local_experts ({experts})")
            moe = MoEConfig(experts, chosen, number(c, "intermediate_size"), normalize=True, shared_ffn_dims=shared)
        rope = c.get("position_embedding_type") == "rope"
        return replace(
            arch,
            ffn_dims=shared,
            moe=moe,
            recurrent=state_space(c, arch.dims, arch.layers),
            unrotated_layers=() if rope else tuple(range(arch.layers)),
            embed_scale=number(c, "embedding_multiplier", 1.0, float),
            query_scale=number(c, "attention_multiplier", arch.head_dim**-0.5, float),
            residual_scale=number(c, "residual_multiplier", 1.0, float),
            logit_divisor=number(c, "logits_scaling", 1.0, float),
        )

    def convert_weights(self, weights: dict) -> dict:
        """The shared SwiGLU is the FFN of a dense model, the shared expert of a mixture."""
        shared = "ffn.shared_experts" if self.moe is not None else "ffn"
        weights = {k.replace(".shared_mlp.", f".{shared}."): v for k, v in self.names.to_ours(weights).items()}
        return super().convert_weights(weights)

    recurrent_module = "mamba"

    def export_weights(self, weights: dict) -> dict:
        """mlx-lm's layout: a dense model's FFN apart (`mlp`), a mixture's shared expert with gate and up fused
        (`shared_mlp.input_linear`) beside its experts (`block_sparse_moe.switch_mlp`)."""
        if self.moe is not None:
            shared = {
                k.replace(".ffn.shared_experts.", ".shared_mlp."): v for k, v in weights.items() if ".shared_" in k
            }
            rest = {k: v for k, v in weights.items() if ".shared_" not in k}
            weights = {**rest, **fuse(shared, "gate_up_proj", ["gate_proj", "up_proj"])}
        return self.exported_names(weights)

    def export_config(self, config: dict) -> dict:
        """The config as mlx-lm's Granite 4 reads it: layer kinds named "mamba" and "attention", a dense model's FFN
        width as `intermediate_size` (its `shared_intermediate_size`), and the keys it requires."""
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        kinds = config.get("layer_types") or config.get("layers_block_type")
        layers = self.recurrent.layers
        kinds = kinds or ["mamba" if i in layers else "attention" for i in range(self.layers)]
        config = {"attention_bias": False, **config, "layer_types": [names.get(kind, kind) for kind in kinds]}
        if self.moe is None:
            config["intermediate_size"] = self.ffn_dims
        return config

    gguf_architectures = ("granitehybrid",)
    gguf_names = LLAMA_GGUF_NAMES.extended(
        [
            ("blk.{i}.ssm_in.", "layers.{i}.attn.in_proj."),
            ("blk.{i}.ssm_conv1d.", "layers.{i}.attn.conv1d."),
            ("blk.{i}.ssm_dt.bias", "layers.{i}.attn.dt_bias"),
            ("blk.{i}.ssm_a", "layers.{i}.attn.A_log"),
            ("blk.{i}.ssm_d", "layers.{i}.attn.D"),
            ("blk.{i}.ssm_norm.", "layers.{i}.attn.norm."),
            ("blk.{i}.ssm_out.", "layers.{i}.attn.out_proj."),
        ]
    )
    gguf_rows_permuted = True

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's keys: Mamba2's as its `ssm.*` (time_step_rank the heads, inner_size their width), the scalings
        as `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale`; the FFN's width is
        feed_forward_length (the experts' in a mixture, beside the shared expert's)."""
        m = Metadata(metadata)
        config = hybrid_layers(llama_config(metadata, tensors, "granitemoehybrid"), "mamba", "attention")
        heads, inner = m["ssm.time_step_rank"], m["ssm.inner_size"]
        first = config["layer_types"].index("mamba") if "mamba" in config["layer_types"] else 0
        experts = m.get("expert_count", 0)
        shared = m["expert_shared_feed_forward_length"] if experts else m["feed_forward_length"]
        return {
            **config,
            "mamba_n_heads": heads,
            "mamba_d_head": inner // heads,
            "mamba_d_state": m["ssm.state_size"],
            "mamba_n_groups": m["ssm.group_count"],
            "mamba_d_conv": m["ssm.conv_kernel"],
            "mamba_expand": inner // config["hidden_size"],
            "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in tensors,
            "mamba_proj_bias": f"blk.{first}.ssm_in.bias" in tensors,
            "position_embedding_type": "rope" if m.get("rope.scaling.finetuned", True) else "nope",
            "embedding_multiplier": m.get("embedding_scale", 1.0),
            "residual_multiplier": m.get("residual_scale", 1.0),
            "attention_multiplier": m.get("attention.scale") or config["head_dim"] ** -0.5,
            "logits_scaling": m.get("logit_scale", 1.0),
            "num_local_experts": experts,
            "num_experts_per_tok": m.get("expert_used_count", 0),
            "shared_intermediate_size": shared,
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's tensors back to the checkpoint's: A_log from its -exp(A_log), A, D and the norm's weight as
        vectors, the convolution (channels, kernel, 1)."""
        weights = {}
        for name, w in super().convert_gguf_weights(tensors, metadata).items():
            if name.endswith(".A_log"):
                w = mx.log(-w)
            if name.endswith((".A_log", ".D", ".attn.norm.weight")):
                w = w.reshape(-1)
            elif name.endswith(".conv1d.weight"):
                w = w[..., None]
            weights[name] = w
        return weights
