"""Tiny random Hugging Face checkpoints of the families the fine-tuning tests adapt, and their PEFT counterparts:
a minimlx model and a transformers + PEFT model holding the same base and the same adapter numbers."""

from pathlib import Path

import numpy as np
from reference import require, save_reference

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# Gemma 3: windows of 4 tokens in two of three layers (the 12-token batches cross them), its own RoPE per kind.
FAMILIES = {
    "llama": ("LlamaConfig", dict(SMALL, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=16, tie_word_embeddings=True)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            SMALL,
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
            ),
        ),
    ),
    # layer 0 dense (a SwiGLU to adapt), layer 1 a mixture of experts (its attention adapted)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            SMALL,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # experts in every layer, stored (experts, in, out) with gate and up interleaved; biases, sinks, windows of 4
    "gpt_oss": (
        "GptOssConfig",
        dict(
            SMALL,
            intermediate_size=16,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=32, truncate=False
            ),
        ),
    ),
    # experts in every layer, stored (experts, in, out), gate rows first, not flagged as transposed for PEFT
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            SMALL,
            intermediate_size=16,
            intermediate_size_mlp=64,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 0],
            attention_chunk_size=4,
            tie_word_embeddings=False,
        ),
    ),
}
# the mixtures whose experts' adapters the tests compare with PEFT's
MIXTURES = ("qwen3_moe", "gpt_oss", "llama4_text")
TARGETS = {
    "llama": "all-linear",
    "qwen3": ("q_proj", "v_proj", "down_proj"),
    "gemma3": "all-linear",
    # attention only: on transformers' MoE models PEFT turns FFN targets (and all-linear) into its adapters of the
    # experts' stacked parameters (and the routers'), with twice the rank on gate_up_proj (EXPERTS adapts those)
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gpt_oss": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "llama4_text": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
# the experts' stacked projections (PEFT's target_parameters) beside two attention projections
EXPERTS = dict(targets=("q_proj", "v_proj"), experts=("gate_up_proj", "down_proj"))


def save_family(folder: Path, family: str):
    """The tiny random model of `family` saved to `folder`; returns the torch model."""
    config_class, config = FAMILIES[family]
    return save_reference(folder, config_class, **config)


def batches(count: int, seed: int = 0, batch: int = 2, tokens: int = 12) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` (ids, mask) batches: random ids, and a mask that leaves out a prompt at the start of row 0 and
    padding at the end of row 1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(0, VOCAB, size=(batch, tokens))
        mask = np.ones_like(ids)
        mask[0, : rng.integers(1, tokens // 2)] = 0
        mask[1, tokens - rng.integers(1, tokens // 2) :] = 0
        out.append((ids, mask))
    return out


def randomize_adapters(model, seed: int = 0) -> None:
    """Non-zero adapters (B too, so that A's gradients are not zero; DoRA magnitudes off their norms)."""
    import mlx.core as mx

    from minimlx.tune import DoRALinear, adapters
    from minimlx.tune.lora import expert_adapters

    rng = np.random.default_rng(seed)
    low_ranks = [form[p] for form in expert_adapters(model).values() for p in form.adapted]
    for module in [*adapters(model).values(), *low_ranks]:
        module.lora_a = mx.array(rng.normal(0, 0.2, module.lora_a.shape).astype(np.float32))
        module.lora_b = mx.array(rng.normal(0, 0.2, module.lora_b.shape).astype(np.float32))
        if isinstance(module, DoRALinear):
            module.magnitude = module.weight_norm() * mx.array(
                rng.uniform(0.8, 1.2, module.magnitude.shape), mx.float32
            )


def peft_twin(torch_model, settings, adapter_folder: Path):
    """`torch_model` with a PEFT adapter of `settings` (LoraConfig built from them, targets as given: all-linear
    expanded by PEFT itself) holding the tensors of the adapter minimlx saved in `adapter_folder`; checks that PEFT
    adapts the same modules minimlx saved. Returns the PeftModel."""
    peft = require("peft")
    safetensors_torch = require("safetensors.torch")
    targets = settings.targets if isinstance(settings.targets, str) else list(settings.targets)
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        target_parameters=list(settings.experts) or None,
        use_dora=settings.dora,
        task_type="CAUSAL_LM",
    )
    twin = peft.get_peft_model(torch_model, config)
    saved = safetensors_torch.load_file(str(adapter_folder / "adapter_model.safetensors"))
    result = peft.set_peft_model_state_dict(twin, saved)
    ours = {k.replace(".lora_magnitude_vector", ".lora_magnitude_vector.weight") for k in saved}
    theirs = {k.replace(".default", "") for k, p in twin.named_parameters() if p.requires_grad}
    assert ours == theirs and not result.unexpected_keys, (sorted(ours ^ theirs), result.unexpected_keys)
    return twin


def peft_name(model, name: str) -> str:
    """PEFT's parameter name (in the PeftModel, adapter `default`) of a minimlx adapter tensor `<path>.<kind>`."""
    from minimlx.tune.formats import peft_names

    saved = peft_names(model)[name]
    if saved.endswith(".lora_magnitude_vector"):
        return f"{saved}.default.weight"
    return f"{saved.removesuffix('.weight')}.default.weight"


def torch_loss(twin, ids: np.ndarray, mask: np.ndarray):
    """transformers' causal-LM loss of `ids`, counting the tokens `mask` marks (labels -100 elsewhere)."""
    torch = require("torch")
    labels = torch.tensor(np.where(mask == 1, ids, -100))
    return twin(torch.tensor(ids), labels=labels).loss
