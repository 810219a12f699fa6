"""Tiny random models in the layouts mlx-lm writes, for the format tests: Hugging Face folders with a
small tokenizer (what `mlx_lm.convert` needs), and the folders mlx-lm converts them into."""

from pathlib import Path

from reference import require, save_reference, to_v4_layout

VOCAB = 128
# Widths are multiples of 64 so that every matrix is quantized at group size 64.
CONFIGS = {
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=256,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=64,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            max_position_embeddings=256,
        ),
    ),
}


def save_tokenizer(folder: Path, eos: str = "w1") -> None:
    """A word-level tokenizer over VOCAB made-up words, saved the way transformers saves any tokenizer. Its end token
    is matched inside words too (w1 in w10): the words a test writes do not start with it."""
    tokenizers, transformers = require("tokenizers"), require("transformers")
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token=eos)
    tokenizer.save_pretrained(folder)


def save_hf_model(folder: Path, name: str, seed: int = 0):
    """The random transformers model `name` (a CONFIGS key) saved with a tokenizer, its config in the layout
    published checkpoints have (mlx-lm reads only that one); returns the torch model."""
    config_class, config = CONFIGS[name]
    model = save_reference(folder, config_class, seed, ("e_score_correction_bias",), vocab_size=VOCAB, **config)
    to_v4_layout(folder)
    save_tokenizer(folder)
    return model


def mlx_lm_convert(source: Path, target: Path, **options) -> Path:
    """`mlx_lm.convert` (the Python form of `mlx_lm.convert --hf-path ...`) of a local folder."""
    require("mlx_lm")
    from mlx_lm import convert

    convert(str(source), str(target), **options)
    return target


def mlx_lm_logits(folder: Path, ids):
    """mlx-lm's float32 logits for `ids` on its own loading of `folder` (packed weights stay packed)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    model.set_dtype(mx.float32)
    logits = model(mx.array(ids))
    mx.eval(logits)
    return logits
