"""Mixture-of-experts families: deepseek (DeepSeek-MoE 16B) and gpt_oss.

DeepSeek-MoE has no transformers class: its reference is assembled from transformers' Llama and DeepSeek-V2
modules (tests/reference.py). gpt-oss is compared with transformers' own model, in float and MXFP4 checkpoints.
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from reference import random_ids, reference_logits, relative_error, save_deepseek_moe_reference

import minimlx
from minimlx.archs import build_model
from minimlx.core import MoE, SwiGLU

VOCAB = 128
DEEPSEEK = dict(  # DeepSeek-MoE 16B's config.json, shrunk
    model_type="deepseek", architectures=["DeepseekForCausalLM"], vocab_size=VOCAB, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
    moe_layer_freq=1, norm_topk_prob=False, scoring_func="softmax", rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=128, attention_bias=False, torch_dtype="float32",
)
DEEPSEEK_CONFIGS = {
    "deepseek_16b": DEEPSEEK,
    "deepseek_renormalised_every_other": dict(
        DEEPSEEK, num_hidden_layers=4, num_key_value_heads=2, moe_layer_freq=2, norm_topk_prob=True
    ),
}


def close(model, ids, reference):
    """Relative errors of the full forward and of token-by-token decoding (after a 9-token prefill)."""
    full = relative_error(np.array(model(mx.array(ids))), reference)
    cache = model.make_cache()
    steps = [model(mx.array(ids[:, :9]), cache)] + [model(mx.array(ids[:, t : t + 1]), cache) for t in range(9, 16)]
    return full, relative_error(np.array(mx.concatenate(steps, axis=1)), reference)


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_CONFIGS))
def deepseek(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    torch_model = save_deepseek_moe_reference(folder, DEEPSEEK_CONFIGS[request.param])
    ids = random_ids(VOCAB)
    return folder, reference_logits(torch_model, ids), ids


def test_deepseek_matches_its_assembled_reference(deepseek):
    folder, reference, ids = deepseek
    model = minimlx.load_model(folder, dtype="float32")
    full, cached = close(model, ids, reference)
    assert full <= 1e-4 and cached <= 1e-4


def test_deepseek_layers_shared_experts_and_routing():
    model = build_model(DEEPSEEK_CONFIGS["deepseek_renormalised_every_other"])
    assert [type(layer.ffn) for layer in model.layers] == [SwiGLU, SwiGLU, MoE, SwiGLU]  # dense first, then every 2nd
    moe = model.layers[2].ffn
    assert moe.shared_experts.gate_proj.weight.shape == (2 * 32, 64)  # two shared experts run as one
    assert moe.experts.up_proj.weight.shape == (8, 32, 64)
    assert (moe.num_experts, moe.experts_per_token, moe.router.normalize) == (8, 3, True)


@pytest.mark.parametrize("deepseek", ["deepseek_16b"], indirect=True)
def test_deepseek_mlx_lm_folder_matches_mlx_lm(deepseek, tmp_path):
    """mlx-lm's `deepseek` layout (experts stacked as `switch_mlp`), 4-bit, against mlx-lm's own logits."""
    from mlx_lm_reference import mlx_lm_convert, mlx_lm_logits, save_tokenizer

    folder, _, ids = deepseek
    source = shutil.copytree(folder, tmp_path / "source")
    save_tokenizer(source)
    converted = mlx_lm_convert(source, tmp_path / "4bit", quantize=True, q_bits=4, q_group_size=32)
    assert "model.layers.1.mlp.switch_mlp.up_proj.scales" in mx.load(str(converted / "model.safetensors"))
    expected = np.array(mlx_lm_logits(converted, ids))
    for dtype in ("float32", "quantized"):
        model = minimlx.load_model(converted, dtype=dtype)
        assert relative_error(np.array(model(mx.array(ids))), expected) <= 1e-4, dtype
