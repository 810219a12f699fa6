"""Qwen3-Next and Qwen3.5: Qwen3's block where most layers' token-mixer is a Gated DeltaNet (`layer_types`
"linear_attention", or all but every `full_attention_interval`-th) and the others attend with an output gate
(q_proj twice as wide, the second half of each head gating its output) over a quarter of each head turned by RoPE.
Every norm stores its weight as the difference from 1 (the gated norm inside the DeltaNet excepted).

Qwen3-Next's FFN is a mixture of experts with a gated shared expert (Qwen2-MoE's) and its DeltaNet projections come
fused and interleaved per key head (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5 keeps them apart, dense (`qwen3_5_text`)
or with experts (`qwen3_5_moe_text`). The image-text checkpoints (`qwen3_5`, `qwen3_5_moe`) hold the text model under
`model.language_model` beside Qwen3-VL's vision tower (without DeepStack), and read images as Qwen3-VL does.
"""

from dataclasses import dataclass, replace
from typing import ClassVar

import mlx.core as mx

from ..core import OffsetRMSNorm
from .config import number, recurrent_layers, require
from .decoder import DecoderConfig, DeltaNetConfig
from .gguf import Metadata, llama_config, partial_rotary, unpacked
from .names import LLAMA_GGUF_NAMES
from .qwen2 import Qwen2MoeConfig, shared_gate_rows
from .qwen2_vl import QwenImages
from .qwen3 import gguf_experts, qwen_experts
from .qwen3_vl import Qwen3VisionTower, qwen3_vl_names
from .registry import register

NAMES = Qwen2MoeConfig.names.extended([("model.layers.{i}.linear_attn.", "layers.{i}.attn.")], drop=[r"^mtp\."])
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight")
OFFSET_NORMS += (".k_norm.weight",)
"""The norms whose weight a Hugging Face checkpoint stores as the difference from 1 and mlx-lm's whole."""


GGUF_NAMES = LLAMA_GGUF_NAMES.extended(
    [
        ("blk.{i}.post_attention_norm.", "layers.{i}.ffn_norm."),
        ("blk.{i}.attn_qkv.", "layers.{i}.attn.in_proj_qkv."),
        ("blk.{i}.attn_gate.", "layers.{i}.attn.in_proj_z."),
        ("blk.{i}.ssm_alpha.", "layers.{i}.attn.in_proj_a."),
        ("blk.{i}.ssm_beta.", "layers.{i}.attn.in_proj_b."),
        ("blk.{i}.ssm_conv1d.", "layers.{i}.attn.conv1d."),
        ("blk.{i}.ssm_dt.bias", "layers.{i}.attn.dt_bias"),
        ("blk.{i}.ssm_a", "layers.{i}.attn.A_log"),
        ("blk.{i}.ssm_norm.", "layers.{i}.attn.norm."),
        ("blk.{i}.ssm_out.", "layers.{i}.attn.out_proj."),
    ]
)
"""llama.cpp's names of Qwen3.5's tensors (`qwen35`): the DeltaNet's as its `ssm_*`."""
MOE_GGUF_NAMES = GGUF_NAMES.extended([("blk.{i}.ffn_gate_inp_shexp.", "layers.{i}.ffn.shared_gate.")])
"""Qwen3.5-MoE's (`qwen35moe`) and Qwen3-Next's (`qwen3next`, whose DeltaNet keeps `ssm_ba` fused as the checkpoint's
in_proj_ba): the shared expert's gate too."""
GGUF_OFFSET_NORMS = (".attn_norm.weight", ".ffn_norm.weight", ".q_norm.weight", ".k_norm.weight")


def grouped_heads(a: mx.array, axis: int, key_heads: int, head_dims: int) -> mx.array:
    """Value heads along `axis` from llama.cpp's tiled order (head j of every key head's group, for each j) back to
    the checkpoint's grouped one (each key head's group together)."""
    shape = list(a.shape)
    per_key = shape[axis] // (key_heads * head_dims)
    tiled = a.reshape(*shape[:axis], per_key, key_heads, head_dims, *shape[axis + 1 :])
    return mx.swapaxes(tiled, axis, axis + 1).reshape(shape)


def mlx_lm_layout(weights: dict) -> bool:
    """Whether the tensors are as mlx-lm writes them: its convolution weights (channels, kernel, 1), as its own reader
    tells (Hugging Face's are (channels, 1, kernel))."""
    return any(k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] == 1 for k, v in weights.items())


WRAPPING_ARCHITECTURES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def offset_norms(weights: dict, shift: float) -> dict:
    """`weights` with `shift` added to the weights of the `OFFSET_NORMS` (-1 reads mlx-lm's, +1 writes them)."""
    return {k: v + shift if k.endswith(OFFSET_NORMS) and v.ndim == 1 else v for k, v in weights.items()}


def delta_net(config: dict, layers: int) -> DeltaNetConfig:
    """The Gated DeltaNet's sizes and layers: from `layer_types`, else all but every `full_attention_interval`-th."""
    kinds = config.get("layer_types")
    if kinds is None:
        every = number(config, "full_attention_interval", 4)
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    key_heads, value_heads = number(config, "linear_num_key_heads"), number(config, "linear_num_value_heads")
    require(
        value_heads % key_heads == 0,
        f"linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads ({key_heads})",
    )
    return DeltaNetConfig(
        layers=recurrent_layers(kinds, layers, ("linear_attention",), ("full_attention",)),
        key_heads=key_heads,
        value_heads=value_heads,
        key_dims=number(config, "linear_key_head_dim"),
        value_dims=number(config, "linear_value_head_dim"),
        kernel=number(config, "linear_conv_kernel_dim", 4),
    )


@register("qwen3_5_text")
@dataclass
class Qwen35TextConfig(DecoderConfig):
    example_config = {
        "model_type": "qwen3_5_text",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    }
    names = NAMES
    defaults = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

    norm_class: type = OffsetRMSNorm
    qk_norm: bool = True
    attn_output_gate: bool = True

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        return replace(arch, recurrent=delta_net({**cls.defaults, **config}, arch.layers))

    def convert_weights(self, weights: dict) -> dict:
        """An mlx-lm folder's norms back to the differences from 1 the model's `OffsetRMSNorm`s hold."""
        return super().convert_weights(offset_norms(weights, -1.0) if mlx_lm_layout(weights) else weights)

    gguf_architectures = ("qwen35",)
    gguf_names = GGUF_NAMES

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's keys: the DeltaNet's as its `ssm.*` (state_size the key heads' size, group_count their number,
        time_step_rank the value heads'), the recurrent layers as `attention.recurrent_layers`. Its multimodal RoPE
        sections turn a text's positions as plain RoPE does (one position on every axis)."""
        m = Metadata(metadata)
        config = partial_rotary(m, llama_config(metadata, tensors, cls.gguf_model_type))
        value_heads = m["ssm.time_step_rank"]
        if (recurrent := m.get("attention.recurrent_layers")) is not None:
            kinds = {"layer_types": ["linear_attention" if r else "full_attention" for r in recurrent]}
        else:  # an older converter's file: every full_attention_interval-th layer attends
            kinds = {"full_attention_interval": m["full_attention_interval"]}
        return {
            **config,
            **kinds,
            "linear_conv_kernel_dim": m["ssm.conv_kernel"],
            "linear_key_head_dim": m["ssm.state_size"],
            "linear_num_key_heads": m["ssm.group_count"],
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": m["ssm.inner_size"] // value_heads,
        }

    gguf_model_type = "qwen3_5_text"
    gguf_tiled_heads = True
    """Whether llama.cpp's converter stores the value heads tiled (`qwen35`, `qwen35moe`; not `qwen3next`)."""

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's tensors back to the checkpoint's: norms as differences from 1, A_log from its -exp(A_log),
        the convolution (channels, kernel, 1), and the value heads from its tiled order to the grouped one."""
        net = self.recurrent
        weights = {}
        for name, w in super().convert_gguf_weights(tensors, metadata).items():
            if name == "norm.weight" or name.endswith(GGUF_OFFSET_NORMS):
                w = w - 1
            elif name.endswith(".A_log"):
                w = mx.log(-w)
            elif name.endswith(".conv1d.weight"):
                w = w[..., None]
            weights[name] = w
        if net.key_heads == net.value_heads or not self.gguf_tiled_heads:
            return weights
        keys, key_rows = net.key_heads, 2 * net.key_heads * net.key_dims
        for i in net.layers:
            at = f"layers.{i}.attn."
            for module, rows, dims in (
                ("in_proj_qkv", key_rows, net.value_dims),
                ("conv1d", key_rows, net.value_dims),
                ("in_proj_z", 0, net.value_dims),
                ("in_proj_a", 0, 1),
                ("in_proj_b", 0, 1),
            ):
                for leaf in ("weight", "scales", "biases"):  # a packed tensor's rows with their scales and biases
                    if (name := f"{at}{module}.{leaf}") in weights:
                        w = weights[name]
                        weights[name] = mx.concatenate([w[:rows], grouped_heads(w[rows:], 0, keys, dims)])
            for name in ("A_log", "dt_bias"):
                weights[at + name] = grouped_heads(weights[at + name], 0, keys, 1)
            out = unpacked(weights, at + "out_proj.weight", net.value_heads * net.value_dims)
            weights[at + "out_proj.weight"] = grouped_heads(out, 1, keys, net.value_dims)
        return weights

    recurrent_module = "linear_attn"
    wrapping_type: ClassVar[str | None] = "qwen3_5"
    """The image-text model_type mlx-lm reads this text model inside (it has no model of the text model's own type):
    its folder is written as that model's, the config as its `text_config`, the tensors under `language_model`.
    None for a family mlx-lm reads as it is (`qwen3_next`) and for the image-text families themselves."""

    def export_weights(self, weights: dict) -> dict:
        """mlx-lm's layout: the DeltaNet's tensors under `linear_attn`, its convolution (channels, kernel, 1) as the
        model holds it, the offset norms whole; under `language_model` when written inside `wrapping_type`."""
        theirs = offset_norms(super().export_weights(weights), 1.0)
        if self.wrapping_type is None:
            return theirs
        return {f"language_model.{name}": w for name, w in theirs.items()}

    def export_config(self, config: dict) -> dict:
        if self.wrapping_type is None:
            return config
        tied = {"tie_word_embeddings": config["tie_word_embeddings"]} if "tie_word_embeddings" in config else {}
        outer = {
            "model_type": self.wrapping_type,
            "architectures": [WRAPPING_ARCHITECTURES[self.wrapping_type]],
            **tied,
        }
        return {**outer, "text_config": {k: v for k, v in config.items() if k != "architectures"}}


@register("qwen3_5_moe_text")
@dataclass
class Qwen35MoeTextConfig(Qwen35TextConfig):
    example_config = {
        **Qwen35TextConfig.example_config,
        "model_type": "qwen3_5_moe_text",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
    }
    defaults = {**Qwen35TextConfig.defaults, "intermediate_size": 1, "norm_topk_prob": True}

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        c = {**cls.defaults, **config}
        return replace(arch, moe=qwen_experts(c, number(c, "shared_expert_intermediate_size", 0, low=0)))

    gguf_architectures = ("qwen35moe",)
    gguf_names = MOE_GGUF_NAMES
    gguf_model_type = "qwen3_5_moe_text"
    wrapping_type = "qwen3_5_moe"

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """Qwen3.5's keys and the experts' (llama.cpp's graph renormalises the chosen experts' weights)."""
        m = Metadata(metadata)
        return {
            **super().gguf_config(metadata, tensors),
            **gguf_experts(metadata),
            "shared_expert_intermediate_size": m.get("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": True,
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        return shared_gate_rows(super().convert_gguf_weights(tensors, metadata))


@register("qwen3_next")
@dataclass
class Qwen3NextConfig(Qwen35MoeTextConfig):
    example_config = {**Qwen35MoeTextConfig.example_config, "model_type": "qwen3_next"}

    def export_weights(self, weights: dict) -> dict:
        """The four projections fused back into in_proj_qkvz and in_proj_ba, interleaved per key head."""
        net, fused = self.recurrent, {}
        groups = {"in_proj_qkv": ("in_proj_z", "in_proj_qkvz"), "in_proj_b": ("in_proj_a", "in_proj_ba")}
        for name, w in weights.items():
            module, _, leaf = name.rpartition(".")
            prefix, _, projection = module.rpartition(".")
            if projection in ("in_proj_z", "in_proj_a"):
                continue
            if projection not in groups:
                fused[name] = w
                continue
            partner, joined = groups[projection]
            other = weights[f"{prefix}.{partner}.{leaf}"]
            if projection == "in_proj_qkv":
                key_rows = net.key_heads * net.key_dims
                parts = [w[:key_rows], w[key_rows : 2 * key_rows], w[2 * key_rows :], other]
            else:
                parts = [w, other]
            fused[f"{prefix}.{joined}.{leaf}"] = interleaved(parts, net.key_heads)
        return super().export_weights(fused)

    def export_config(self, config: dict) -> dict:
        """The config with the keys mlx-lm's Qwen3-Next requires (every layer's FFN a mixture) and its router's
        normalisation said (mlx-lm's default is not transformers')."""
        required = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": self.moe.normalize}
        return {**required, **config}

    def convert_weights(self, weights: dict) -> dict:
        return super().convert_weights(self.split_projections(weights))

    gguf_architectures = ("qwen3next",)
    gguf_names = MOE_GGUF_NAMES.extended([("blk.{i}.ssm_ba.", "layers.{i}.attn.in_proj_ba.")])
    gguf_model_type = "qwen3_next"
    wrapping_type = None
    gguf_tiled_heads = False

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """Qwen3.5-MoE's reading (the converter splits in_proj_qkvz itself, keeping the value heads grouped), then
        in_proj_ba split."""
        return self.split_projections(super().convert_gguf_weights(tensors, metadata))

    def split_projections(self, weights: dict) -> dict:
        """The fused, per-key-head interleaved in_proj_qkvz and in_proj_ba split into the four projections (their
        weights, and the scales and biases of packed ones)."""
        net, split = self.recurrent, {}
        for name, w in weights.items():
            module, _, leaf = name.rpartition(".")
            prefix, _, projection = module.rpartition(".")
            if projection not in ("in_proj_qkvz", "in_proj_ba"):
                split[name] = w
                continue
            grouped = w.reshape(net.key_heads, -1, *w.shape[1:])
            values = net.value_heads // net.key_heads * net.value_dims
            if projection == "in_proj_qkvz":
                q, k, v, z = mx.split(grouped, [net.key_dims, 2 * net.key_dims, 2 * net.key_dims + values], axis=1)
                rows = [a.reshape(-1, *w.shape[1:]) for a in (q, k, v, z)]
                split[f"{prefix}.in_proj_qkv.{leaf}"] = mx.concatenate(rows[:3])
                split[f"{prefix}.in_proj_z.{leaf}"] = rows[3]
            else:
                b, a = mx.split(grouped, 2, axis=1)
                split[f"{prefix}.in_proj_b.{leaf}"] = b.reshape(-1, *w.shape[1:])
                split[f"{prefix}.in_proj_a.{leaf}"] = a.reshape(-1, *w.shape[1:])
        return split


def interleaved(parts: list[mx.array], heads: int) -> mx.array:
    """The rows of `parts` stacked per head: each part's rows of head 0, then of head 1, ... (Qwen3-Next's fused
    projections). A part without rows per head (convert's one-row module tags) is stacked as it is."""
    if any(p.shape[0] % heads for p in parts):
        return mx.concatenate(parts)
    grouped = [p.reshape(heads, p.shape[0] // heads, *p.shape[1:]) for p in parts]
    return mx.concatenate(grouped, axis=1).reshape(-1, *parts[0].shape[1:])


@register("qwen3_5")
@dataclass
class Qwen35Config(Qwen3VisionTower, QwenImages, Qwen35TextConfig):
    """Qwen3.5's image-text checkpoints: the text model from `text_config` (under `model.language_model`), Qwen3-VL's
    tower without DeepStack from `vision_config` (a checkpoint without one reads text only)."""

    example_config = {
        "model_type": "qwen3_5",
        "text_config": {
            **Qwen35TextConfig.example_config,
            "rope_parameters": {"rope_theta": 1e4, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.25},
        },
    }
    names = qwen3_vl_names(NAMES)
    wrapping_type = None


@register("qwen3_5_moe")
@dataclass
class Qwen35MoeConfig(Qwen3VisionTower, QwenImages, Qwen35MoeTextConfig):
    example_config = {
        "model_type": "qwen3_5_moe",
        "text_config": {**Qwen35MoeTextConfig.example_config, **Qwen35Config.example_config["text_config"]},
    }
    names = Qwen35Config.names
    wrapping_type = None
