"""DeepSeek-V2 / V2-Lite / V3 and Kimi K2: latent attention and a mixture of experts with shared experts.

DeepSeek-MoE's blocks and experts (deepseek.py) with multi-head latent attention in place of LLaMA's: RoPE,
usually yarn-scaled, on a `qk_rope_head_dim` slice of each head, interleaved pairs. Routing (`topk_method`):
`greedy` (V2-Lite), `group_limited_greedy` (V2), `noaux_tc` (V3, Kimi K2), as deepseek.py describes.
Checkpoint layers past `num_hidden_layers` (V3's multi-token-prediction module) are not loaded.
"""

import re
from dataclasses import dataclass, replace

import mlx.core as mx

from ..core.rope import yarn_mscale
from ..errors import UnsupportedArchitectureError
from .config import flag, number, require
from .deepseek import DeepseekConfig
from .gguf import Metadata, llama_config, moe_config, unpacked
from .names import GGUF_LAYER_INDEX, LLAMA_GGUF_NAMES, LLAMA_NAMES, within_stack
from .registry import register

# Latent attention's names; mlx-lm stores kv_b_proj already split per head as embed_q / unembed_out.
NAMES = LLAMA_NAMES.extended(
    [
        ("model.layers.{i}.self_attn.q_a_layernorm.", "layers.{i}.attn.q_a_norm."),
        ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.", "layers.{i}.attn.kv_a_proj."),
        ("model.layers.{i}.self_attn.kv_a_layernorm.", "layers.{i}.attn.kv_a_norm."),
        ("model.layers.{i}.self_attn.embed_q.", "layers.{i}.attn.key_up_proj."),
        ("model.layers.{i}.self_attn.unembed_out.", "layers.{i}.attn.value_up_proj."),
    ]
)
# llama.cpp's names (`deepseek2`). Its converter splits kv_b_proj into attn_k_b (W_uk transposed) and attn_v_b, the
# layout of key_up_proj and value_up_proj; files written before that hold attn_kv_b.
GGUF_NAMES = LLAMA_GGUF_NAMES.extended(
    [
        ("blk.{i}.attn_q_a_norm.", "layers.{i}.attn.q_a_norm."),
        ("blk.{i}.attn_q_a.", "layers.{i}.attn.q_a_proj."),
        ("blk.{i}.attn_q_b.", "layers.{i}.attn.q_b_proj."),
        ("blk.{i}.attn_kv_a_mqa.", "layers.{i}.attn.kv_a_proj."),
        ("blk.{i}.attn_kv_a_norm.", "layers.{i}.attn.kv_a_norm."),
        ("blk.{i}.attn_kv_b.", "layers.{i}.attn.kv_b_proj."),
        ("blk.{i}.attn_k_b.", "layers.{i}.attn.key_up_proj."),
        ("blk.{i}.attn_v_b.", "layers.{i}.attn.value_up_proj."),
    ]
)
SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
KV_B_PROJ = re.compile(r"^(layers\.\d+\.attn\.)kv_b_proj\.weight$")


@register("deepseek_v2")
@dataclass
class DeepseekV2Config(DeepseekConfig):
    example_config = {
        **DeepseekConfig.example_config,
        "model_type": "deepseek_v2",
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
    }
    names = NAMES
    gguf_architectures = ("deepseek2",)
    gguf_names = GGUF_NAMES

    @classmethod
    def from_config(cls, config: dict):
        """Latent attention's sizes; RoPE on `qk_rope_head_dim` features of each head, adjacent pairs unless
        `rope_interleave` is false; queries scaled by 1/sqrt(their size), times yarn's `mscale_all_dim`
        temperature squared when the rope is stretched."""
        arch = super().from_config(config)
        nope, rope = number(config, "qk_nope_head_dim"), number(config, "qk_rope_head_dim", low=2)
        scale, scaling = (nope + rope) ** -0.5, arch.rope_scaling or {}
        if scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        return replace(
            arch,
            q_lora_rank=number(config, "q_lora_rank", None),
            latent_dims=number(config, "kv_lora_rank"),
            nope_dims=nope,
            rotary_dims=rope,
            value_dims=number(config, "v_head_dim"),
            interleaved_rope=flag(config, "rope_interleave", True),
            query_scale=scale,
        )

    def convert_weights(self, weights: dict) -> dict:
        return self.split_kv_b_proj(super().convert_weights(within_stack(weights, self.layers)))

    def split_kv_b_proj(self, weights: dict) -> dict:
        """Hugging Face's `kv_b_proj` (heads * (nope + value), latent) -> the per-head W_uk^T and W_uv."""
        out = {}
        for name, w in weights.items():
            if match := KV_B_PROJ.match(name):
                w = w.reshape(self.heads, self.nope_dims + self.value_dims, self.latent_dims)
                out[f"{match[1]}key_up_proj.weight"] = mx.contiguous(w[:, : self.nope_dims].swapaxes(-1, -2))
                out[f"{match[1]}value_up_proj.weight"] = mx.contiguous(w[:, self.nope_dims :])
            else:
                out[name] = w
        return out

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """V2 (softmax routing) or V3 (sigmoid, with a correction bias: files before `expert_gating_func` had
        either softmax or the bias) from llama.cpp's `deepseek2` keys. Its MLA heads: key_length_mla (older
        files: key_length) = nope + rope, value_length_mla (value_length) = value."""
        m = Metadata(metadata)
        config = llama_config(metadata, tensors, "deepseek_v2")
        rope = m["rope.dimension_count"]
        biased = any(name.endswith(".exp_probs_b.bias") for name in tensors)
        gating = m.get("expert_gating_func") or (SIGMOID if biased else SOFTMAX)
        if gating not in (SOFTMAX, SIGMOID):
            raise UnsupportedArchitectureError(
                f"GGUF expert_gating_func {gating} is not supported (supported: 1 softmax, 2 sigmoid)"
            )
        groups = m.get("expert_group_count") or 1
        log_mul = m.get("rope.scaling.yarn_log_multiplier")  # 0.1 * mscale_all_dim; llama.cpp rotates as if mscale
        if config["rope_scaling"] and log_mul:  # equalled it (it does in DeepSeek's releases)
            config["rope_scaling"]["mscale"] = config["rope_scaling"]["mscale_all_dim"] = log_mul / 0.1
        return {
            **config,
            "model_type": "deepseek_v3" if gating == SIGMOID else "deepseek_v2",
            "num_hidden_layers": m["block_count"] - m.get("nextn_predict_layers", 0),
            "num_key_value_heads": config["num_attention_heads"],  # llama.cpp stores MLA as one shared kv head
            "head_dim": rope,
            "q_lora_rank": m.get("attention.q_lora_rank"),
            "kv_lora_rank": m["attention.kv_lora_rank"],
            "qk_nope_head_dim": (m.get("attention.key_length_mla") or m["attention.key_length"]) - rope,
            "qk_rope_head_dim": rope,
            "v_head_dim": m.get("attention.value_length_mla") or m["attention.value_length"],
            "rope_interleave": True,  # llama.cpp rotates adjacent pairs, as DeepSeek does
            **moe_config(m),
            "scoring_func": "sigmoid" if gating == SIGMOID else "softmax",
            "topk_method": "noaux_tc" if gating == SIGMOID else "group_limited_greedy" if groups > 1 else "greedy",
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's names -> the model's, as stored (its converter does not permute DeepSeek's q or kv_a rows);
        an older file's attn_kv_b split per head; multi-token-prediction layers dropped."""
        weights = self.gguf_names.to_ours(within_stack(tensors, self.layers, GGUF_LAYER_INDEX))
        for name in [n for n in weights if KV_B_PROJ.match(n)]:
            weights[name] = unpacked(weights, name)
        return self.split_kv_b_proj(weights)


@register("deepseek_v3", "kimi_k2")
@dataclass
class DeepseekV3Config(DeepseekV2Config):
    example_config = {**DeepseekV2Config.example_config, "model_type": "deepseek_v3", "q_lora_rank": 16, "n_group": 2}
    defaults = {
        **DeepseekV2Config.defaults,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
    }


@register("deepseek_v32")
@dataclass
class DeepseekV32Config(DeepseekV3Config):
    """DeepSeek-V3.2: V3 with DeepSeek Sparse Attention. Each layer's lightning indexer (`index_n_heads` heads of
    `index_head_dim` from the query's low-rank code, one normed key per token, RoPE on the first `qk_rope_head_dim`
    features in rotate-half pairs) chooses the `index_topk` keys each query attends to."""

    example_config = {
        **DeepseekV3Config.example_config,
        "model_type": "deepseek_v32",
        "index_topk": 4,
        "index_n_heads": 2,
        "index_head_dim": 16,
    }
    names = NAMES.extended(
        [
            ("model.layers.{i}.self_attn.indexer.wq_b.", "layers.{i}.attn.indexer.q_proj."),
            ("model.layers.{i}.self_attn.indexer.wk.", "layers.{i}.attn.indexer.k_proj."),
        ]
    )
    defaults = {**DeepseekV3Config.defaults, "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}
    gguf_architectures = ("deepseek32",)
    gguf_names = GGUF_NAMES.extended(
        [
            ("blk.{i}.indexer.attn_q_b.", "layers.{i}.attn.indexer.q_proj."),
            ("blk.{i}.indexer.attn_k.", "layers.{i}.attn.indexer.k_proj."),
            ("blk.{i}.indexer.k_norm.", "layers.{i}.attn.indexer.k_norm."),
            ("blk.{i}.indexer.proj.", "layers.{i}.attn.indexer.weights_proj."),
        ]
    )

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}
        arch = super().from_config(c)
        top_k, index_dims = number(c, "index_topk"), number(c, "index_head_dim")
        require(
            arch.kv_heads == arch.heads,
            f"sparse attention needs num_key_value_heads ({arch.kv_heads}) equal to num_attention_heads ({arch.heads})",
        )
        require(arch.q_lora_rank is not None, "sparse attention's indexer reads the query code: q_lora_rank is needed")
        require(
            top_k <= arch.max_positions,
            f"index_topk ({top_k}) is above the context (max_position_embeddings {arch.max_positions})",
        )
        require(
            arch.rotary_dims <= index_dims,
            f"index_head_dim ({index_dims}) must hold the qk_rope_head_dim ({arch.rotary_dims}) rotated features",
        )
        return replace(arch, index_top_k=top_k, index_heads=number(c, "index_n_heads"), index_head_dim=index_dims)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's `deepseek32`: V3's keys and the indexer's (`attention.indexer.*`; its heads [rope | nope],
        rotated in rotate-half pairs as DeepSeek's, so stored as the checkpoint's)."""
        m = Metadata(metadata)
        return {
            **super().gguf_config(metadata, tensors),
            "model_type": "deepseek_v32",
            "index_topk": m["attention.indexer.top_k"],
            "index_n_heads": m["attention.indexer.head_count"],
            "index_head_dim": m["attention.indexer.key_length"],
        }
