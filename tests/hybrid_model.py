"""A tiny random hybrid model (Qwen3.5's Gated DeltaNet layers beside gated attention) with SmolLM2's tokenizer, and
transformers' greedy ids for it: what the runtime's tests of recurrent state run."""

from pathlib import Path

from llamacpp import smollm2_tokenizer
from models import smollm2_gguf
from reference import require, save_reference

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


QWEN3_5_SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)
"""A tiny Qwen3.5's sizes (FAMILIES' too): value heads two per key head."""

FAMILY_VOCAB = 96
LINEAR = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
QWEN3_5 = dict(QWEN3_5_SIZES, vocab_size=FAMILY_VOCAB, layer_types=LINEAR, max_position_embeddings=256)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", QWEN3_5),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(QWEN3_5, **EXPERTS)),
    "qwen3_next": ("Qwen3NextConfig", dict(QWEN3_5, **EXPERTS, norm_topk_prob=True)),
    "lfm2": (
        "Lfm2Config",
        dict(
            {k: v for k, v in QWEN3_5.items() if not k.startswith(("linear_", "head_dim"))},
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            layer_types=["conv", "full_attention", "conv", "conv"],
            conv_L_cache=3,
            norm_eps=1e-5,
            block_ffn_dim_multiplier=1.5,
            block_multiple_of=16,
        ),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        GRANITE := dict(
            {k: v for k, v in QWEN3_5.items() if not k.startswith(("linear_", "head_dim", "intermediate"))},
            layer_types=["mamba", "attention", "mamba", "mamba"],
            position_embedding_type="rope",
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            num_local_experts=0,
            shared_intermediate_size=96,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            embedding_multiplier=1.5,
            attention_multiplier=0.2,
            residual_multiplier=0.7,
            logits_scaling=2.0,
        ),
    ),
    "granitemoehybrid_moe": (
        "GraniteMoeHybridConfig",
        dict(GRANITE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, position_embedding_type="nope"),
    ),
    "qwen3_5": (
        "Qwen3_5Config",
        dict(
            text_config=QWEN3_5,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64),
        ),
    ),
}
"""The tiny random hybrid families (a recurrent layer and an attention layer among the first layers): name ->
(transformers config class, config)."""


def hybrid_config(vocab: int) -> dict:
    return dict(
        QWEN3_5_SIZES, vocab_size=vocab, layer_types=LAYERS, max_position_embeddings=8192, tie_word_embeddings=True
    )


def hybrid_model(folder: Path, seed: int = 0):
    """Save the model (seeded) with SmolLM2's tokenizer and chat template into `folder`; return the torch model."""
    transformers = require("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer(smollm2_gguf()))
    model = save_reference(folder, "Qwen3_5TextConfig", seed, **hybrid_config(len(tokenizer)))
    tokenizer.save_pretrained(folder)
    return model


def reference_greedy(torch_model, ids: list[int], tokens: int) -> list[int]:
    """transformers' greedy answer of `tokens` tokens to the prompt `ids`."""
    torch = require("torch")
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()
