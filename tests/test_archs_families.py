"""Families a few parameters away from LLaMA and Qwen (qwen2, mistral, mixtral, qwen2_moe, phi3, smollm3), and
those with sliding windows, soft-caps and four norms a block (gemma2, gemma3_text, gemma3, glm4).

Each tiny random transformers model is saved, loaded by minimlx and compared on float32 logits, for the
whole sequence, token by token through the cache, and in the transformers 4 config layout.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference import (
    random_ids,
    reference_checkpoint,
    reference_logits,
    relative_error,
    save_reference,
    to_v4_layout,
)

import minimlx

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
)
LOCAL_LOCAL_GLOBAL = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
CONFIGS = {
    "qwen2": ("Qwen2Config", dict(BASE, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "mistral": ("MistralConfig", dict(BASE, sliding_window=4)),  # rolls over within the 16 test tokens
    "mixtral": ("MixtralConfig", dict(BASE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            BASE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),  # no mlp_only_layers: mlx-lm reads none
    ),
    "phi3": (
        "Phi3Config",
        dict(
            BASE,
            pad_token_id=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        dict(BASE, pad_token_id=None, bos_token_id=None, eos_token_id=None, no_rope_layer_interval=2),
    ),
    # Windows of 4 tokens, so the caches roll over within the 16 test tokens (and the 9-token prefill chunk).
    "gemma2": (
        "Gemma2Config",
        GEMMA := dict(
            BASE,
            head_dim=16,
            tie_word_embeddings=True,
            sliding_window=4,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        GEMMA3 := dict(
            GEMMA,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            layer_types=LOCAL_LOCAL_GLOBAL,
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
            ),
        ),
    ),
    "gemma3": (
        "Gemma3Config",
        dict(
            text_config=GEMMA3,
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            boi_token_index=93,
            eoi_token_index=94,
            image_token_index=95,
        ),
    ),
    "glm4": (
        "Glm4Config",
        dict(
            BASE,
            head_dim=16,
            attention_bias=True,
            pad_token_id=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return reference_checkpoint(tmp_path_factory, request.param, *CONFIGS[request.param], VOCAB)


def assert_matches(folder, reference, ids):
    """The whole sequence at once, and a 9-token prefill then one token at a time through the cache."""
    model = minimlx.load_model(folder, dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4
    cache = model.make_cache()
    steps = [model(mx.array(ids[:, :9]), cache)] + [model(mx.array(ids[:, t : t + 1]), cache) for t in range(9, 16)]
    assert relative_error(np.array(mx.concatenate(steps, axis=1)), reference) <= 1e-4


def test_logits_match_transformers(checkpoint):
    _, folder, reference, ids = checkpoint
    assert_matches(folder, reference, ids)


def test_transformers_4_layout(checkpoint, tmp_path):
    import shutil

    _, folder, reference, ids = checkpoint
    shutil.copytree(folder, tmp_path / "v4")
    to_v4_layout(tmp_path / "v4")
    model = minimlx.load_model(tmp_path / "v4", dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def test_phi3_slides_its_window_past_the_window(tmp_path):
    """Phi-3's window (4 tokens of the 16) rolls through its caches exactly; the context stays the model's."""
    torch_model = save_reference(tmp_path, "Phi3Config", **dict(CONFIGS["phi3"][1], sliding_window=4))
    ids = random_ids(VOCAB)
    assert_matches(tmp_path, reference_logits(torch_model, ids), ids)
    model = minimlx.load_model(tmp_path)
    assert model.config.max_positions == 128 and {layer.attn.window for layer in model.layers} == {4}


WINDOWED = {  # a window of 8 over the layers transformers derives from max_window_layers 1 of 3
    "qwen2": (dict(CONFIGS["qwen2"][1], num_hidden_layers=3), [None, 8, 8]),
    "qwen2_moe": (dict(CONFIGS["qwen2_moe"][1], num_hidden_layers=3), [8, None, None]),  # every other, below 1
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_qwen2_slides_its_window_over_the_layers_past_max_window_layers(family, tmp_path):
    """24 tokens through an 8-token window, token by token through the caches, give transformers' logits at each
    length; the same layers without the window do not. The context stays the model's (not cut to the window)."""
    import json
    import shutil

    config, windows = WINDOWED[family]
    config = dict(config, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    torch_model = save_reference(tmp_path / "v5", CONFIGS[family][0], **config)
    ids = random_ids(VOCAB, tokens=24)
    reference = reference_logits(torch_model, ids)
    shutil.copytree(tmp_path / "v5", tmp_path / "v4")
    written = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert written.pop("layer_types") == ["sliding_attention" if w else "full_attention" for w in windows]
    (tmp_path / "v4" / "config.json").write_text(json.dumps(written))  # only max_window_layers says which
    for folder in ("v5", "v4"):
        model = minimlx.load_model(tmp_path / folder, dtype="float32")
        assert [layer.attn.window for layer in model.layers] == windows and model.config.max_positions == 128
        cache = model.make_cache()
        steps = np.array(mx.concatenate([model(mx.array(ids[:, t : t + 1]), cache) for t in range(24)], axis=1))
        assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4, folder
        assert relative_error(steps, reference) <= 1e-4, folder
    written["use_sliding_window"] = False
    (tmp_path / "v4" / "config.json").write_text(json.dumps(written))
    unwindowed = minimlx.load_model(tmp_path / "v4", dtype="float32")
    assert relative_error(np.array(unwindowed(mx.array(ids)))[:, :8], reference[:, :8]) <= 1e-4
    assert relative_error(np.array(unwindowed(mx.array(ids)))[:, 8:], reference[:, 8:]) > 1e-2


@pytest.mark.parametrize("checkpoint", ["phi3"], indirect=True)
def test_phi3_rotates_half_of_each_head_and_writes_fused_projections(checkpoint):
    _, folder, *_ = checkpoint
    model = minimlx.load_model(folder)
    assert model.layers[0].attn.rope.dims == 8  # head_dim 16, partial_rotary_factor 0.5
    written = model.config.export_weights(dict(tree_flatten(model.parameters())))
    assert written["model.layers.0.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    assert written["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)


@pytest.mark.parametrize("checkpoint", ["smollm3"], indirect=True)
def test_smollm3_leaves_rope_out_of_every_other_layer(checkpoint):
    _, folder, *_ = checkpoint
    model = minimlx.load_model(folder)
    assert [layer.attn.rope is not None for layer in model.layers] == [True, False, True, False]


@pytest.mark.parametrize("checkpoint", ["gemma3_text", "glm4", "mixtral", "phi3", "qwen2_moe"], indirect=True)
def test_mlx_lm_4bit_folder_matches_mlx_lm(checkpoint, tmp_path):
    """mlx-lm's own names and layouts: Mixtral's switch_mlp, Phi-3's and GLM-4's fused projections kept packed,
    Qwen2-MoE's shared expert and gate, Gemma 3's windows. (mlx-lm's gemma2 has no sliding window: it differs
    from transformers past the window, so it is no reference here.)"""
    import shutil

    from mlx_lm_reference import mlx_lm_convert, mlx_lm_logits, save_tokenizer

    _, folder, _, ids = checkpoint
    source = tmp_path / "source"
    shutil.copytree(folder, source)
    to_v4_layout(source)  # the layout mlx-lm reads
    save_tokenizer(source)
    converted = mlx_lm_convert(source, tmp_path / "4bit", quantize=True, q_bits=4, q_group_size=32)
    expected = np.array(mlx_lm_logits(converted, ids))
    for dtype in ("float32", "quantized"):
        model = minimlx.load_model(converted, dtype=dtype)
        assert relative_error(np.array(model(mx.array(ids))), expected) <= 1e-4, dtype


@pytest.mark.parametrize("checkpoint", ["gemma3_text"], indirect=True)
def test_gemma3_layers_are_local_but_every_third_and_their_caches_stay_at_the_window(checkpoint):
    _, folder, _, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert [layer.attn.window for layer in model.layers] == [4, 4, None, 4]
    assert [layer.attn.rope._wavelengths[1].item() for layer in model.layers[1:3]] == pytest.approx(
        [100 ** (2 / 16), 2 * 1000000 ** (2 / 16)], rel=1e-5
    )  # local base 100; global 1e6, linear factor 2
    cache, held = model.make_cache(), []
    for t in range(16):
        model(mx.array(ids[:, t : t + 1]), cache)
        mx.eval([c.state for c in cache])
        held.append([c.nbytes for c in cache])
    token = 2 * 2 * 2 * 16 * 4  # keys and values, 2 rows, 2 kv heads, head_dim 16, float32
    assert all(sizes[0] == sizes[1] == sizes[3] == 3 * token for sizes in held[3:])
    assert held[-1][2] >= 16 * token  # the global layer keeps every token


@pytest.mark.parametrize("checkpoint", ["glm4"], indirect=True)
def test_glm4_rotates_interleaved_pairs_of_half_of_each_head_and_writes_a_fused_ffn(checkpoint):
    _, folder, *_ = checkpoint
    model = minimlx.load_model(folder)
    rope = model.layers[0].attn.rope
    assert rope.dims == 8 and rope.traditional
    written = model.config.export_weights(dict(tree_flatten(model.parameters())))
    assert written["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)
    assert written["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in written


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_gemma3_image_text_checkpoint_loads_its_text_model_and_writes_published_names(checkpoint):
    _, folder, *_ = checkpoint
    model = minimlx.load_model(folder)
    assert [layer.attn.window for layer in model.layers] == [4, 4, None, 4] and model.tied_head
    written = model.config.export_weights(dict(tree_flatten(model.parameters())))
    assert "language_model.model.layers.2.post_feedforward_layernorm.weight" in written
    towers = ("vision_tower.vision_model.", "multi_modal_projector.")  # the published checkpoints' names
    assert not [name for name in written if not name.startswith(("language_model.model.", *towers))]
    assert written["vision_tower.vision_model.embeddings.patch_embedding.weight"].shape == (16, 3, 14, 14)


def test_minimlx_archs_lists_the_families_with_their_parts():
    from minimlx.cli.archs import plugins

    parts = {model_type: set(row["parts"]) for row in plugins() for model_type in row["model_types"]}
    gemma = {"FourNormBlock", "GatedFFN", "OffsetRMSNorm", "RotatingKVCache", "KVCache"}
    assert gemma <= parts["gemma2"] and gemma <= parts["gemma3_text"] and gemma <= parts["gemma3"]
    assert {"FourNormBlock", "RMSNorm", "SwiGLU"} <= parts["glm4"] and "RotatingKVCache" not in parts["glm4"]
    assert "RotatingKVCache" in parts["mistral"]  # its example has a window
