"""MiniMax-M2 (`model_type: minimax_m2`, M2 and M2.1): Mixtral's layout with sigmoid routing and whole-projection
query/key norms.

Blocks: RMSNorm -> grouped-query attention -> RMSNorm -> a mixture of `num_local_experts` SwiGLU experts in every
layer. Queries and keys are RMS-normalised over the whole projection (all heads at once, `qk_norm_type: per_layer`)
before RoPE, which turns the first `rotary_dim` features of each head (rotate-half pairs). The router scores experts
with a sigmoid; a correction bias (`e_score_correction_bias`) shifts the scores that choose the top
`num_experts_per_tok`, whose unshifted scores are renormalised to sum to 1. Expert tensors are Mixtral's (`w1` gate,
`w3` up, `w2` down, under `block_sparse_moe`). llama.cpp's `minimax-m2` files keep the q/k rows as stored.
"""

from dataclasses import dataclass, replace

from .config import choice, number, require
from .experts import MoEConfig
from .gguf import Metadata, llama_config
from .mistral import MixtralConfig
from .registry import register


@register("minimax_m2")
@dataclass
class MiniMaxM2Config(MixtralConfig):
    example_config = {
        **MixtralConfig.example_config,
        "model_type": "minimax_m2",
        "sliding_window": None,
        "head_dim": 16,
        "rotary_dim": 8,
    }
    names = MixtralConfig.names.extended(
        [
            ("model.layers.{i}.block_sparse_moe.e_score_correction_bias", "layers.{i}.ffn.router.score_bias"),
            ("model.layers.{i}.mlp.e_score_correction_bias", "layers.{i}.ffn.router.score_bias"),
            ("model.layers.{i}.mlp.experts.", "layers.{i}.ffn.experts."),
        ]
    )
    defaults = {"rms_norm_eps": 1e-6, "rope_theta": 5000000.0}
    gguf_architectures = ("minimax-m2",)
    gguf_rows_permuted = False

    qk_norm: bool = True
    qk_norm_per_head: bool = False

    @classmethod
    def from_config(cls, config: dict):
        """`rotary_dim` (the published configs' key) or `partial_rotary_factor`; the sigmoid, bias-corrected router."""
        c = {**cls.defaults, **config}
        arch = super().from_config(c)
        rotary = number(c, "rotary_dim", arch.rotary_dims, low=2)
        require(rotary <= arch.head_dim and rotary % 2 == 0, f"rotary_dim ({rotary}) must be even, at most head_dim")
        choice(c, "scoring_func", "sigmoid", ("sigmoid",))
        choice(c, "qk_norm_type", "per_layer", ("per_layer",))
        moe = MoEConfig(
            arch.moe.num_experts, arch.moe.experts_per_token, arch.ffn_dims, "sigmoid", normalize=True, score_bias=True
        )
        return replace(arch, rotary_dims=rotary, moe=moe)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        return {
            **llama_config(metadata, tensors, "minimax_m2"),
            "rotary_dim": m["rope.dimension_count"],
            "num_local_experts": m["expert_count"],
            "num_experts_per_tok": m["expert_used_count"],
            "intermediate_size": m["expert_feed_forward_length"],
        }
