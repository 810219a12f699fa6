"""The tiny random configs of the 2025-26 families (olmo3, ministral3, mistral3 with either text model, mistral4,
llama4, deepseek_v32, glm4_moe, minimax_m2): every layer kind among the first layers, windows and chunks shorter than
the 16 test tokens, sparse attention choosing fewer keys than it sees. name -> (transformers config class, config,
save_reference's options)."""

import copy
import shutil
from pathlib import Path

from reference import save_reference

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(  # the smallest vision tower: image-text checkpoints hold one, which minimlx skips
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
MINISTRAL3 = dict(
    BASE,
    head_dim=16,
    sliding_window=6,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=1000000.0,
        factor=16.0,
        original_max_position_embeddings=4,  # the query temperature rises every 4 positions
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        llama_4_scaling_beta=0.1,
    ),
)
MISTRAL4 = dict(
    BASE,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
    first_k_dense_replace=1,
    rope_parameters=dict(MINISTRAL3["rope_parameters"], rope_theta=10000.0, partial_rotary_factor=0.5),
)
LLAMA4 = dict(
    BASE,
    intermediate_size=32,
    intermediate_size_mlp=96,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,  # dense, MoE, dense, MoE
    no_rope_layers=[1, 1, 1, 0],  # the fourth layer: no RoPE, the whole text, the query temperature
    attention_chunk_size=4,  # four chunks in the 16 test tokens
    floor_scale=4,
    attn_scale=0.5,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)


def mistral3(text: dict, model_type: str) -> tuple:
    """A Mistral 3 image-text checkpoint's CONFIGS entry around the text model `text` of type `model_type`."""
    config = dict(text_config=dict(text, model_type=model_type), vision_config=dict(VISION, head_dim=8))
    return "Mistral3Config", dict(config, image_token_index=95), dict(model_class="Mistral3ForConditionalGeneration")


CONFIGS = {
    "olmo3": (
        "Olmo3Config",
        dict(
            BASE,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=500000.0),
            ),
        ),
    ),
    "ministral3": ("Ministral3Config", MINISTRAL3),
    "mistral3": mistral3(MINISTRAL3, "ministral3"),
    "mistral4": ("Mistral4Config", MISTRAL4, dict(model_class="Mistral4ForCausalLM")),
    "mistral3_mistral4": mistral3(MISTRAL4, "mistral4"),  # Mistral 4 as published (Mistral Small 4)
    "llama4_text": ("Llama4TextConfig", LLAMA4),
    "llama4": (
        "Llama4Config",
        dict(
            text_config=LLAMA4,
            vision_config=dict(VISION, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16),
            image_token_index=95,
        ),
        dict(model_class="Llama4ForConditionalGeneration"),
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        DEEPSEEK_V32 := dict(
            MISTRAL4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            index_topk=5,  # of up to 16 keys
            index_n_heads=8,
            index_head_dim=16,
        ),
        dict(random_buffers=("e_score_correction_bias",)),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            BASE,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
        dict(random_buffers=("e_score_correction_bias",)),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(
            BASE,
            intermediate_size=32,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            rotary_dim=8,  # the published key for RoPE on half of each head
        ),
        dict(random_buffers=("e_score_correction_bias",)),
    ),
}


def family_config(name: str, **changes) -> dict:
    """CONFIGS[name]'s config with `changes` made to its text model's settings (those under `text_config` in an
    image-text config)."""
    config = copy.deepcopy(CONFIGS[name][1])
    if "text_config" in config:
        config["text_config"].update(changes)
        return config
    return {**config, **changes}


def save_family(folder: Path, name: str, config: dict | None = None):
    """The seeded random transformers model of family `name` (its config, or `config`) saved to `folder`; returns
    the torch model."""
    config_class, default, *options = CONFIGS[name]
    return save_reference(folder, config_class, **(options[0] if options else {}), **(config or default))


GGUF_VOCAB = 49152  # SmolLM2's tokenizer, one llama.cpp's converter recognises
GLM_TOKENS = ("[gMASK]", "<|user|>", "<|observation|>")  # the special tokens llama.cpp's glm4moe converter looks up
# name -> (the family's config as llama.cpp's converter writes it, its llama.cpp architecture). FFNs 256 wide, so that
# llama-quantize's K-quants apply to their down projections (rows of 256); heads tied to the token embedding but in
# OLMo 3 and Llama 4 (the 49152-token matrices are most of each file). The converter writes no sliding window for
# Ministral 3 (the published configs have none), and no chunk, temperature floor or scale for Llama 4: llama.cpp
# takes Scout's (chunks of 8192, longer than any test text). It converts Mistral 4 only as the text of an image-text
# checkpoint, without its query temperature (llama.cpp applies none then): the source's beta is 0 (no temperature).
# DeepSeek V3.2's tokenizer declares its BOS token (the converter asserts it) and its config the published
# scoring_func (llama.cpp needs the gating key it becomes).
GGUF_FAMILIES = {
    "olmo3": (family_config("olmo3", vocab_size=GGUF_VOCAB, intermediate_size=256), "olmo2"),
    "ministral3": (
        family_config(
            "ministral3", vocab_size=GGUF_VOCAB, intermediate_size=256, sliding_window=None, tie_word_embeddings=True
        ),
        "mistral3",
    ),
    "mistral3": (
        family_config("mistral3", vocab_size=GGUF_VOCAB, intermediate_size=256, sliding_window=None),
        "mistral3",
    ),
    "glm4_moe": (
        family_config(
            "glm4_moe", vocab_size=GGUF_VOCAB + len(GLM_TOKENS), intermediate_size=256, tie_word_embeddings=True
        ),
        "glm4moe",
    ),
    "minimax_m2": (
        family_config("minimax_m2", vocab_size=GGUF_VOCAB, intermediate_size=256, tie_word_embeddings=True),
        "minimax-m2",
    ),
    "deepseek_v32": (
        family_config(
            "deepseek_v32",
            vocab_size=GGUF_VOCAB,
            intermediate_size=256,
            tie_word_embeddings=True,
            scoring_func="sigmoid",
        ),
        "deepseek32",
    ),
    "mistral3_mistral4": (
        family_config(
            "mistral3_mistral4",
            vocab_size=GGUF_VOCAB,
            intermediate_size=256,
            tie_word_embeddings=True,
            rope_parameters=dict(MISTRAL4["rope_parameters"], llama_4_scaling_beta=0.0),
        ),
        "mistral4",
    ),
    "llama4": (
        family_config(
            "llama4",
            vocab_size=GGUF_VOCAB,
            intermediate_size_mlp=256,
            attention_chunk_size=8192,
            floor_scale=8192,
            attn_scale=0.1,
        ),
        "llama4",
    ),
}


def convert_families(root: Path, kinds: dict[str, tuple[str, ...]]) -> dict:
    """Each family of `kinds` (GGUF_FAMILIES' names) saved as root / name with SmolLM2's tokenizer and converted by
    llama.cpp's converter to root / f"{name}-{kind}.gguf" for each of its kinds; returns each one's transformers
    model."""
    from llamacpp import convert
    from llamacpp_models import add_token, converter_inputs, declare_bos

    sources, tokenizer = converter_inputs()
    models, jobs = {}, []
    for name, its_kinds in kinds.items():
        folder = root / name
        models[name] = save_family(folder, name, GGUF_FAMILIES[name][0])
        shutil.copytree(tokenizer, folder, dirs_exist_ok=True)
        if name == "glm4_moe":
            add_token(folder, *GLM_TOKENS)
        if name == "deepseek_v32":
            declare_bos(folder)
        jobs += [(folder, kind, root / f"{name}-{kind}.gguf") for kind in its_kinds]
    convert(jobs, sources)
    return models
