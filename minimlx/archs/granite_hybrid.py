"""Granite 4 (`granitemoehybrid`): LLaMA's block where most layers' token-mixer is Mamba2's selective state-space
layer (`layer_types` "mamba", or transformers 5's "linear_attention") and the others attend, with RoPE or none
(`position_embedding_type`). The FFN is a SwiGLU (`shared_mlp`, gate and up fused as `input_linear`) beside a
mixture of experts when `num_local_experts` (softmax over the chosen experts' logits). Scalings: the embedding by
`embedding_multiplier`, attention scores by `attention_multiplier` (not 1/sqrt(head_dim)), each sub-layer's output
by `residual_multiplier`, the logits divided by `logits_scaling`.
"""

from dataclasses import dataclass, replace

from ..errors import CheckpointError
from .config import flag, number, recurrent_layers, require
from .decoder import DecoderConfig, StateSpaceConfig
from .experts import MoEConfig
from .names import LLAMA_NAMES
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
