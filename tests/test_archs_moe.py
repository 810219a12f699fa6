"""Mixture-of-experts and latent-attention architectures against transformers.

Small random qwen3_moe, deepseek_v2 (with and without query compression) and deepseek_v3 models:
logits in both config layouts and both expert layouts, cached decoding, the latent cache's size,
a checkpoint carrying an extra (multi-token-prediction) layer, and routing done by gathered matmuls.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from reference import random_ids, reference_logits, relative_error, save_reference, to_v4_layout

import minimlx
from minimlx.archs import build_model
from minimlx.core import LatentCache, MoE, SwiGLU
from minimlx.errors import UnsupportedArchitectureError

VOCAB = 96
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    mscale=0.9,
    mscale_all_dim=0.7,
    beta_fast=32,
    beta_slow=1,
)
LATENT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    rope_parameters=YARN,
)
CONFIGS = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            max_position_embeddings=128,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(LATENT, topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=1.5),
    ),
    "deepseek_v2_lite": ("DeepseekV2Config", dict(LATENT, q_lora_rank=None, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", dict(LATENT, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """name -> (name, folder, torch model, reference logits, ids), each reference built once."""
    built = {}

    def get(name):
        if name not in built:
            config_class, config = CONFIGS[name]
            folder = tmp_path_factory.mktemp(name)
            torch_model = save_reference(folder, config_class, random_buffers=("e_score_correction_bias",), **config)
            ids = random_ids(VOCAB)
            built[name] = name, folder, torch_model, reference_logits(torch_model, ids), ids
        return built[name]

    return get


@pytest.fixture(params=sorted(CONFIGS))
def checkpoint(request, build):
    return build(request.param)


@pytest.fixture(params=[name for name in sorted(CONFIGS) if name.startswith("deepseek")])
def latent_checkpoint(request, build):
    return build(request.param)


def test_checkpoint_has_per_expert_tensors_and_a_random_correction_bias(checkpoint):
    name, folder, *_ = checkpoint
    tensors = mx.load(str(folder / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # the leading dense layer
    if name == "deepseek_v3":
        assert mx.abs(tensors["model.layers.2.mlp.gate.e_score_correction_bias"]).min().item() > 0


@pytest.mark.parametrize("layout", ["transformers5_config", "transformers4_config", "fused_experts"])
def test_logits_match_transformers(checkpoint, layout, tmp_path):
    _, folder, torch_model, reference, ids = checkpoint
    if layout == "transformers4_config":
        folder = shutil.copytree(folder, tmp_path / "v4")
        to_v4_layout(folder)
    elif layout == "fused_experts":  # transformers' in-memory layout: gate_up_proj (E, 2I, D), down_proj (E, D, I)
        torch_model.save_pretrained(tmp_path, save_original_format=False)
        assert "model.layers.1.mlp.experts.gate_up_proj" in mx.load(str(tmp_path / "model.safetensors"))
        folder = tmp_path
    logits = np.array(minimlx.load_model(folder)(mx.array(ids)))
    assert logits.shape == reference.shape == (2, 16, VOCAB)
    assert relative_error(logits, reference) <= 1e-4


@pytest.mark.parametrize("chunks", [[1] * 16, [5, 3, 1, 7]], ids=["token_by_token", "prefill_in_chunks"])
def test_cached_decoding_matches_the_full_forward(checkpoint, chunks):
    _, folder, _, reference, ids = checkpoint
    model = minimlx.load_model(folder)
    cache, start, steps = model.make_cache(), 0, []
    for size in chunks:
        steps.append(model(mx.array(ids[:, start : start + size]), cache))
        start += size
    assert relative_error(np.array(mx.concatenate(steps, axis=1)), reference) <= 1e-4


def test_latent_cache_holds_the_latent_and_the_rope_key_only(latent_checkpoint):
    _, folder, *_, ids = latent_checkpoint
    model = minimlx.load_model(folder)
    cache = model.make_cache()
    mx.eval(model(mx.array(ids), cache))
    per_token = LATENT["kv_lora_rank"] + LATENT["qk_rope_head_dim"]  # 24 numbers, not 4 heads * (20 + 10)
    for layer_cache in cache:
        assert isinstance(layer_cache, LatentCache) and layer_cache.offset == 16
        (stored,) = layer_cache.state
        batch, _, capacity, features = stored.shape
        assert (batch, features) == (2, per_token)
        assert layer_cache.nbytes == batch * capacity * per_token * 4


def test_layers_beyond_num_hidden_layers_are_ignored(latent_checkpoint, tmp_path):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last one."""
    _, folder, _, reference, ids = latent_checkpoint
    tensors = mx.load(str(folder / "model.safetensors"))
    extra = {k.replace("model.layers.2.", "model.layers.3.", 1): v for k, v in tensors.items() if ".layers.2." in k}
    extra |= {f"model.layers.3.{norm}.weight": mx.ones(48) for norm in ("enorm", "hnorm")}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors | extra)
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 3
    model = minimlx.load_model(tmp_path)
    assert len(model.layers) == 3
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def test_experts_run_as_gathered_matmuls_not_a_loop(checkpoint, monkeypatch):
    _, folder, *_, ids = checkpoint
    model = minimlx.load_model(folder)
    moe_layers = [layer.ffn for layer in model.layers if isinstance(layer.ffn, MoE)]
    assert len(moe_layers) == 2 and not isinstance(model.layers[0].ffn, MoE)
    for moe in moe_layers:
        assert moe.num_experts == 8 and moe.experts_per_token == 2
        assert moe.experts.gate_proj.weight.shape == (8, 24, 48)
        assert moe.experts.down_proj.weight.shape == (8, 48, 24)
    calls = []
    gather_mm = mx.gather_mm
    monkeypatch.setattr(mx, "gather_mm", lambda *a, **k: calls.append(1) or gather_mm(*a, **k))
    mx.eval(model(mx.array(ids)))
    assert len(calls) == 3 * len(moe_layers)  # gate, up, down per layer, whatever the number of experts


def test_correction_bias_chooses_experts_but_does_not_weight_them(build):
    _, folder, *_, ids = build("deepseek_v3")
    moe = minimlx.load_model(folder).layers[2].ffn
    x = mx.random.normal((2, 16, 48), key=mx.random.key(0))
    expert_indices, expert_weights = moe.route(x)
    chosen = np.take_along_axis(np.array(mx.sigmoid(x @ moe.router.proj.weight.T)), np.array(expert_indices), axis=-1)
    np.testing.assert_allclose(np.array(expert_weights), 2.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)
    moe.router.score_bias = mx.zeros_like(moe.router.score_bias)
    assert not np.array_equal(np.sort(np.array(moe.route(x)[0]), -1), np.sort(np.array(expert_indices), -1))


def test_layer_schedule():
    qwen = dict(
        model_type="qwen3_moe",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        moe_intermediate_size=4,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    deepseek = dict(
        LATENT,
        model_type="deepseek_v3",
        num_hidden_layers=6,
        first_k_dense_replace=1,
        moe_layer_freq=2,
        n_group=4,
        topk_group=2,
    )
    for config, expected in ((qwen, [1, 5]), (deepseek, [2, 4])):
        model = build_model(config)
        assert [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)] == expected
        assert all(isinstance(layer.ffn, SwiGLU) for i, layer in enumerate(model.layers) if i not in expected)


def test_unknown_routing_is_a_user_error():
    config = dict(LATENT, model_type="deepseek_v2", topk_method="sinkhorn")
    with pytest.raises(UnsupportedArchitectureError, match="topk_method 'sinkhorn'"):
        build_model(config)
