"""Tiny seeded random models of four layouts (learned positions, grouped queries, mixture of experts, latent
attention) built straight from configs, and the ids they are traced on: the anatomy tests' models."""

import mlx.core as mx
from mlx.utils import tree_map

from minimlx.archs import build_model

VOCAB = 64
CONFIGS = {
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    "llama": dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ),
}


def random_model(model_type: str):
    model = build_model(CONFIGS[model_type])
    mx.random.seed(0)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    mx.eval(model.parameters())
    return model


IDS = mx.array([[5, 17, 3, 42, 8, 8, 60, 1, 29, 11]])
