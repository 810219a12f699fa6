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
"""A tiny Qwen3.5's sizes (tests/test_archs_families_hybrid.py's too): value heads two per key head."""


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
