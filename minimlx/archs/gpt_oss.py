"""gpt-oss (`model_type: gpt_oss`, gpt-oss-20b and -120b): attention sinks, alternating windows, biased experts.

Blocks: RMSNorm -> grouped-query attention with biases, yarn RoPE and a learned sink logit per head, over a
`sliding_window` for the layers `layer_types` marks `sliding_attention` (every other one) and over the whole
text for the others -> RMSNorm -> a mixture of experts: a router with a bias picks `num_experts_per_tok` of
`num_local_experts` experts by logit and weights them by a softmax over the chosen logits; each expert is
down(clamped_swiglu(gate(x), up(x))) with a bias on every projection (`swiglu_alpha`, `swiglu_limit`).

Checkpoints store each layer's experts fused, gate and up rows interleaved: `experts.gate_up_proj` as
(experts, dims, 2 * hidden) in float, or in MXFP4 as `gate_up_proj_blocks` / `_scales` (experts, 2 * hidden, ...),
the layout of MLX's mxfp4 quantization, which loading keeps packed or dequantizes (`quantization_config`
names the mode). mlx-lm's folders hold the experts split (`gate_proj`, `up_proj`, `down_proj`), as the model does,
and so do llama.cpp's `gpt-oss` files, their MXFP4 experts read as MLX mxfp4 bit for bit (io/gguf_file.py).
"""

import re
from dataclasses import dataclass, replace

import mlx.core as mx

from ..quantization import mxfp4_from_blocks
from .config import global_layers, number, require
from .decoder import DecoderConfig
from .experts import ExpertsLayout, MoEConfig
from .gguf import Metadata, llama_config, windows
from .llama3 import Llama3Config
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES
from .registry import register

# `...experts.gate_up_proj` / `down_proj`, and their `_bias`, `_blocks`, `_scales`
FUSED_EXPERTS = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
SPLIT_EXPERTS = re.compile(r"^(.*\.experts\.)(gate_proj|up_proj|down_proj)\.(weight|bias)$")  # as the model's
# float weights stored (experts, in, out); gate_up_proj's outputs alternate: gate, up, gate, up, ...
INTERLEAVED = ExpertsLayout(transposed=True, interleaved=True)


def split_experts(weights: dict) -> dict:
    """Fused, interleaved experts (float or MXFP4 blocks) -> `gate_proj`, `up_proj`, `down_proj`, as the model's."""
    out = {}
    for name, w in weights.items():
        match = FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = w
            continue
        experts, fused, part = match.groups()
        if part is None:
            w, part = INTERLEAVED.stored(w), "_weight"
        elif part == "_blocks":
            w, part = mxfp4_from_blocks(w), "_weight"
        tensor = part.replace("_", ".")
        if fused == "down_proj":
            out[f"{experts}down_proj{tensor}"] = mx.contiguous(w)
        else:
            out[f"{experts}gate_proj{tensor}"], out[f"{experts}up_proj{tensor}"] = INTERLEAVED.split_gate_up(w, axis=1)
    return out


def fuse_experts(weights: dict) -> dict:
    """Split float experts (`gate_proj`, `up_proj`, `down_proj`) -> the checkpoint's fused, interleaved ones (the
    inverse of `split_experts`)."""
    out = {}
    for name, w in weights.items():
        match = SPLIT_EXPERTS.match(name)
        if match is None:
            out[name] = w
            continue
        experts, projection, tensor = match.groups()
        suffix = "_bias" if tensor == "bias" else ""
        if projection == "down_proj":
            out[f"{experts}down_proj{suffix}"] = w if suffix else INTERLEAVED.stored(w)
        elif projection == "gate_proj":
            both = INTERLEAVED.fuse_gate_up(w, weights[f"{experts}up_proj.{tensor}"], axis=1)
            out[f"{experts}gate_up_proj{suffix}"] = both if suffix else INTERLEAVED.stored(both)
    return out


@register("gpt_oss")
@dataclass
class GptOssConfig(DecoderConfig):
    example_config = {
        **Llama3Config.example_config,
        "model_type": "gpt_oss",
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
    }
    names = LLAMA_NAMES.extended(  # mlx-lm keeps the name `experts` (not `switch_mlp`) for gpt-oss
        [
            ("model.layers.{i}.mlp.router.", "layers.{i}.ffn.router.proj."),
            ("model.layers.{i}.mlp.experts.", "layers.{i}.ffn.experts."),
        ]
    )
    gguf_architectures = ("gpt-oss",)
    gguf_names = LLAMA_GGUF_NAMES.extended(
        [
            ("blk.{i}.attn_sinks.weight", "layers.{i}.attn.sinks"),
            ("blk.{i}.post_attention_norm.", "layers.{i}.ffn_norm."),
        ]
    )
    defaults = {"rope_theta": 150000.0, "head_dim": 64, "attention_bias": True}
    experts_layout = INTERLEAVED

    sinks: bool = True

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        experts = number(config, "num_local_experts")
        chosen = number(config, "num_experts_per_tok", None) or number(config, "experts_per_token", 4)
        require(chosen <= experts, f"num_experts_per_tok ({chosen}) must be at most num_local_experts ({experts})")
        moe = MoEConfig(
            experts,
            chosen,
            arch.ffn_dims,
            normalize=True,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=number(config, "swiglu_limit", 7.0, float),
            swiglu_alpha=number(config, "swiglu_alpha", 1.702, float),
        )
        window = number(config, "sliding_window", None)
        # without layer_types: sliding, full, sliding, ...
        return replace(arch, moe=moe, window=window, global_layers=global_layers(config, arch.layers, 2))

    def convert_weights(self, weights: dict) -> dict:
        """The checkpoint's fused experts split apart, then renamed as every family's tensors are."""
        return super().convert_weights(split_experts(weights))

    def export_hf_weights(self, weights: dict) -> dict:
        """Hugging Face's layout: the experts fused again, gate and up rows interleaved, float weights stored
        (experts, in, out)."""
        return fuse_experts(self.export_weights(weights))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's keys; the experts' width is `expert_feed_forward_length`; windows alternate unless the file
        says otherwise."""
        m = Metadata(metadata)
        return {
            **llama_config(metadata, tensors, "gpt_oss"),
            **windows(m, 2),
            "num_local_experts": m["expert_count"],
            "num_experts_per_tok": m["expert_used_count"],
            "intermediate_size": m["expert_feed_forward_length"],
        }
