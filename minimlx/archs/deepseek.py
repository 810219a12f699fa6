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

from ..errors import UnsupportedArchitectureError
from .config import flag, number, require
from .decoder import DecoderConfig
from .experts import MoEConfig
from .gguf import Metadata, llama_config, moe_config
from .llama3 import Llama3Config
from .registry import register

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def deepseek_experts(config: dict) -> MoEConfig | None:
    """DeepSeek's mixture of experts, its routing and its shared experts; None without routed experts."""
    moe_ffn_dims = number(config, "moe_intermediate_size", 0, low=0)
    experts = number(config, "n_routed_experts", 0, low=0)
    chosen = number(config, "num_experts_per_tok", 1)
    shared = number(config, "n_shared_experts", 0, low=0)
    scoring, topk_method = config.get("scoring_func") or "softmax", config.get("topk_method") or "greedy"
    normalize = flag(config, "norm_topk_prob")
    groups, groups_kept = number(config, "n_group", 1), number(config, "topk_group", 1)
    scale = number(config, "routed_scaling_factor", 1.0, float)
    first_dense = number(config, "first_k_dense_replace", 0, low=0)
    every = number(config, "moe_layer_freq", 1)
    if topk_method not in TOPK_METHODS or scoring not in ("softmax", "sigmoid"):
        raise UnsupportedArchitectureError(
            f"unsupported expert routing (topk_method {topk_method!r}, scoring_func {scoring!r}) "
            f"in config.json; minimlx routes with topk_method {', '.join(TOPK_METHODS)} and scoring_func softmax "
            "or sigmoid (fix config.json, or register a plugin for this model_type)"
        )
    if not experts:
        return None
    require(
        chosen <= experts and experts % groups == 0 and groups_kept <= groups,
        f"the experts do not add up: n_routed_experts {experts}, num_experts_per_tok "
        f"{chosen}, n_group {groups}, topk_group {groups_kept}",
    )
    return MoEConfig(
        experts,
        chosen,
        moe_ffn_dims,
        scoring,
        normalize,
        groups=groups if topk_method != "greedy" else 1,
        groups_kept=groups_kept,
        group_top=2 if topk_method == "noaux_tc" else 1,
        score_bias=topk_method == "noaux_tc",
        scale=scale,
        shared_ffn_dims=moe_ffn_dims * shared,
        first_dense=first_dense,
        every=every,
    )


@register("deepseek")
@dataclass
class DeepseekConfig(DecoderConfig):
    example_config = {
        **Llama3Config.example_config,
        "model_type": "deepseek",
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
    }
    defaults = {"rms_norm_eps": 1e-6}
    gguf_architectures = ("deepseek",)
    gguf_rows_permuted = True

    @classmethod
    def from_config(cls, config: dict):
        return replace(super().from_config(config), moe=deepseek_experts({**cls.defaults, **config}))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        return {**llama_config(metadata, tensors, "deepseek"), **moe_config(m), "norm_topk_prob": False}
