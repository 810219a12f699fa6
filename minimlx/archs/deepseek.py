"""DeepSeek-MoE (`model_type: deepseek`, the 16B model): LLaMA's attention, fine-grained and shared experts.

Blocks: RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> a SwiGLU FFN for the first
`first_k_dense_replace` layers (and those off the `moe_layer_freq` beat), a mixture of experts in the others:
- `n_routed_experts` narrow SwiGLU experts (`moe_intermediate_size` wide); a softmax router picks
  `num_experts_per_tok` of them, their weights renormalised to sum to 1 when `norm_topk_prob`;
- `n_shared_experts` experts that every token passes through, run as one SwiGLU
  `n_shared_experts * moe_intermediate_size` wide (the same function as their sum).

DeepSeek-V2 and V3 (deepseek_moe.py) keep this mixture, add the routings below, and swap the attention for latent
attention. Routing (`topk_method`): `greedy` (softmax scores, the top k); `group_limited_greedy` (the same within
the `topk_group` groups holding the highest scores); `noaux_tc` (sigmoid scores plus a correction bias pick the
`topk_group` groups, ranked by their two best, and the experts; weights renormalised and scaled).
"""

from dataclasses import dataclass, replace

import mlx.nn as nn

from ..core import Experts, MoE, Router, SwiGLU, is_moe_layer
from ..errors import UnsupportedArchitectureError
from .config import flag, normalize_config, number, require
from .experts import stack_experts
from .llama3 import Llama3Config
from .registry import register

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@register("deepseek")
@dataclass
class DeepseekConfig(Llama3Config):
    example_config = {
        **Llama3Config.example_config,
        "model_type": "deepseek",
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
    }

    num_experts: int = 0
    experts_per_token: int = 1
    moe_ffn_dims: int = 0
    shared_ffn_dims: int = 0
    scoring: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = False
    groups: int = 1
    groups_kept: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    @classmethod
    def from_config(cls, config: dict):
        c = normalize_config(config)
        c.setdefault("rms_norm_eps", 1e-6)
        moe_ffn_dims = number(c, "moe_intermediate_size", 0, low=0)
        arch = replace(
            super().from_config(c),
            num_experts=number(c, "n_routed_experts", 0, low=0),
            experts_per_token=number(c, "num_experts_per_tok", 1),
            moe_ffn_dims=moe_ffn_dims,
            shared_ffn_dims=moe_ffn_dims * number(c, "n_shared_experts", 0, low=0),
            scoring=c.get("scoring_func") or cls.scoring,
            topk_method=c.get("topk_method") or cls.topk_method,
            norm_topk_prob=flag(c, "norm_topk_prob", cls.norm_topk_prob),
            groups=number(c, "n_group", 1),
            groups_kept=number(c, "topk_group", 1),
            routed_scaling_factor=number(c, "routed_scaling_factor", 1.0, float),
            first_k_dense_replace=number(c, "first_k_dense_replace", 0, low=0),
            moe_layer_freq=number(c, "moe_layer_freq", 1),
        )
        if arch.num_experts:
            require(
                arch.experts_per_token <= arch.num_experts
                and arch.num_experts % arch.groups == 0
                and arch.groups_kept <= arch.groups,
                f"the experts do not add up: n_routed_experts {arch.num_experts}, num_experts_per_tok "
                f"{arch.experts_per_token}, n_group {arch.groups}, topk_group {arch.groups_kept}",
            )
        return arch

    def __post_init__(self):
        if self.topk_method not in TOPK_METHODS or self.scoring not in ("softmax", "sigmoid"):
            raise UnsupportedArchitectureError(
                f"unsupported expert routing (topk_method {self.topk_method!r}, scoring_func {self.scoring!r}) "
                f"in config.json; minimlx routes with topk_method {', '.join(TOPK_METHODS)} and scoring_func softmax "
                "or sigmoid (fix config.json, or register a plugin for this model_type)"
            )

    def ffn(self, layer: int) -> nn.Module:
        if self.num_experts == 0 or not is_moe_layer(layer, self.first_k_dense_replace, self.moe_layer_freq):
            return super().ffn(layer)
        limited = self.topk_method != "greedy"
        router = Router(
            self.dims,
            self.num_experts,
            self.experts_per_token,
            self.scoring,
            self.norm_topk_prob,
            groups=self.groups if limited else 1,
            groups_kept=self.groups_kept,
            group_top=2 if self.topk_method == "noaux_tc" else 1,
            score_bias=self.topk_method == "noaux_tc",
            scale=self.routed_scaling_factor,
        )
        shared = SwiGLU(self.dims, self.shared_ffn_dims, bias=self.mlp_bias) if self.shared_ffn_dims else None
        return MoE(router, Experts(self.dims, self.moe_ffn_dims, self.num_experts), shared)

    def convert_weights(self, weights: dict) -> dict:
        """Hugging Face's per-expert tensors or mlx-lm's `switch_mlp` stacks -> the stacked experts."""
        return stack_experts(super().convert_weights(weights))
