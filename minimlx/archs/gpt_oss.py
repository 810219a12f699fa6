"""gpt-oss (`model_type: gpt_oss`, gpt-oss-20b and -120b): attention sinks, alternating windows, biased experts.

Blocks: RMSNorm -> grouped-query attention with biases, yarn RoPE and a learned sink logit per head, over a
`sliding_window` for the layers `layer_types` marks `sliding_attention` (every other one) and over the whole
text for the others -> RMSNorm -> a mixture of experts: a router with a bias picks `num_experts_per_tok` of
`num_local_experts` experts by logit and weights them by a softmax over the chosen logits; each expert is
down(clamped_swiglu(gate(x), up(x))) with a bias on every projection (`swiglu_alpha`, `swiglu_limit`).

Checkpoints store each layer's experts fused, gate and up rows interleaved: `experts.gate_up_proj` as
(experts, dims, 2 * hidden) in float, or in MXFP4 as `gate_up_proj_blocks` / `_scales` (experts, 2 * hidden, ...),
the layout of MLX's mxfp4 quantization, which loading keeps packed or dequantizes (`quantization_config`
names the mode). mlx-lm's folders hold the experts split (`gate_proj`, `up_proj`, `down_proj`), as the model does.
"""

import re
from dataclasses import dataclass, replace
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..core import Attention, Block, Experts, MoE, RMSNorm, Router, clamped_swiglu
from ..quantization import mxfp4_from_blocks
from .config import normalize_config, number, require, sliding_layers
from .llama3 import NAMES, Llama3Config
from .registry import register

# `...experts.gate_up_proj` / `down_proj`, and their `_bias`, `_blocks`, `_scales`, after the names map
FUSED_EXPERTS = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@register("gpt_oss")
@dataclass
class GptOssConfig(Llama3Config):
    example_config = {
        **Llama3Config.example_config,
        "model_type": "gpt_oss",
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
    }
    names = NAMES.extended(  # mlx-lm keeps the name `experts` (not `switch_mlp`) for gpt-oss
        [
            ("model.layers.{i}.mlp.router.", "layers.{i}.ffn.router.proj."),
            ("model.layers.{i}.mlp.experts.", "layers.{i}.ffn.experts."),
        ]
    )

    num_experts: int = 0
    experts_per_token: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    window: int | None = None
    sliding: tuple = ()  # per layer: whether it attends over the window only

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        c.setdefault("rope_theta", 150000.0)
        c.setdefault("head_dim", 64)
        c.setdefault("attention_bias", True)
        base = super().from_config(c)
        arch = replace(
            base,
            num_experts=number(c, "num_local_experts"),
            experts_per_token=number(c, "num_experts_per_tok", None) or number(c, "experts_per_token", 4),
            swiglu_alpha=number(c, "swiglu_alpha", 1.702, float),
            swiglu_limit=number(c, "swiglu_limit", 7.0, float),
            window=number(c, "sliding_window", None),
            sliding=sliding_layers(c, base.layers, 2),  # without layer_types: sliding, full, sliding, ...
        )
        require(
            arch.experts_per_token <= arch.num_experts,
            f"num_experts_per_tok ({arch.experts_per_token}) must be at most num_local_experts ({arch.num_experts})",
        )
        return arch

    def layer_attention(self, layer: int) -> Attention:
        bias, window = self.attention_bias, self.window if self.sliding[layer] else None
        return Attention(
            self.dims, self.heads, self.kv_heads, self.head_dim, self.rope(), bias, bias, window=window, sinks=True
        )

    def ffn(self, layer: int) -> nn.Module:
        router = Router(self.dims, self.num_experts, self.experts_per_token, "softmax", normalize=True, logit_bias=True)
        activation = partial(clamped_swiglu, alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return MoE(router, Experts(self.dims, self.ffn_dims, self.num_experts, bias=True, activation=activation))

    def block(self, layer: int) -> Block:
        return Block(
            self.layer_attention(layer),
            self.ffn(layer),
            RMSNorm(self.dims, self.norm_eps),
            RMSNorm(self.dims, self.norm_eps),
        )

    def convert_weights(self, weights: dict) -> dict:
        """Fused, interleaved experts (float or MXFP4 blocks) -> the model's `gate_proj`, `up_proj`, `down_proj`."""
        out = {}
        for name, w in super().convert_weights(weights).items():
            match = FUSED_EXPERTS.match(name)
            if match is None:
                out[name] = w
                continue
            experts, fused, part = match.groups()
            if part is None:  # float weights are stored (experts, in, out)
                w, part = w.swapaxes(-1, -2), "_weight"
            elif part == "_blocks":
                w, part = mxfp4_from_blocks(w), "_weight"
            tensor = part.replace("_", ".")
            if fused == "down_proj":
                out[f"{experts}down_proj{tensor}"] = mx.contiguous(w)
            else:  # rows alternate: gate, up, gate, up, ...
                out[f"{experts}gate_proj{tensor}"] = mx.contiguous(w[:, ::2])
                out[f"{experts}up_proj{tensor}"] = mx.contiguous(w[:, 1::2])
        return out
