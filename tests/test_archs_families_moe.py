"""Mixture-of-experts families: deepseek (DeepSeek-MoE 16B) and gpt_oss.

DeepSeek-MoE has no transformers class: its reference is assembled from transformers' Llama and DeepSeek-V2
modules (tests/reference.py). gpt-oss is compared with transformers' own model, in float and MXFP4 checkpoints.
"""

import json
import shutil
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_unflatten
from reference import (
    random_ids,
    reference_logits,
    relative_error,
    require,
    save_deepseek_moe_reference,
    save_mxfp4_experts,
    save_reference,
    to_v4_layout,
)

import minimlx
from minimlx.archs import build_model, plugin_config
from minimlx.core import MoE, SwiGLU, clamped_swiglu
from minimlx.core.moe import QuantizedExpertLinear
from minimlx.errors import CheckpointError

VOCAB = 128
DEEPSEEK = dict(  # DeepSeek-MoE 16B's config.json, shrunk
    model_type="deepseek",
    architectures=["DeepseekForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    norm_topk_prob=False,
    scoring_func="softmax",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=128,
    attention_bias=False,
    torch_dtype="float32",
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


GPT_OSS = dict(
    model_type="gpt_oss",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)


def test_gpt_oss_experts_match_transformers():
    """Biased router and experts, interleaved gate/up, clamped SwiGLU: one MoE layer against GptOssMLP."""
    torch, transformers = require("torch"), require("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    reference = GptOssMLP(transformers.GptOssConfig(**GPT_OSS))
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))  # gate and up values of ~8 standard deviations: the clamps at 7 bite
        x = torch.randn(2, 16, 64)
        expected = reference(x)[0].numpy()
    arch = plugin_config(GPT_OSS)
    checkpoint = {f"model.layers.0.mlp.{k}": mx.array(v.detach().numpy()) for k, v in reference.state_dict().items()}
    moe = arch.ffn(0)
    moe.update(
        tree_unflatten([(k.removeprefix("layers.0.ffn."), v) for k, v in arch.convert_weights(checkpoint).items()])
    )
    assert relative_error(np.array(moe(mx.array(x.numpy()))), expected) <= 1e-5
    moe.experts.activation = partial(clamped_swiglu, alpha=1.702, limit=float("inf"))  # the same without clamps
    assert relative_error(np.array(moe(mx.array(x.numpy()))), expected) > 0.1


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(float folder, its reference logits, MXFP4 folder, transformers' dequantized logits of it, ids)."""
    dense, mxfp4 = tmp_path_factory.mktemp("gpt_oss"), tmp_path_factory.mktemp("gpt_oss_mxfp4")
    config = {k: v for k, v in GPT_OSS.items() if k != "model_type"}
    torch_model = save_reference(dense, "GptOssConfig", **config)
    ids = random_ids(VOCAB)
    return (
        dense,
        reference_logits(torch_model, ids),
        mxfp4,
        reference_logits(save_mxfp4_experts(dense, mxfp4), ids),
        ids,
    )


def test_gpt_oss_matches_transformers_through_a_wrapping_window(gpt_oss):
    """Window 4, 16 tokens: the sliding layers' rotating caches wrap during the token-by-token decode."""
    dense, reference, *_, ids = gpt_oss
    model = minimlx.load_model(dense, dtype="float32")
    assert [layer.attn.window for layer in model.layers] == [4, None]
    full, cached = close(model, ids, reference)
    assert full <= 1e-4 and cached <= 1e-4
    for layer in model.layers:  # the learned sinks take a real share of attention
        layer.attn.sinks = mx.zeros_like(layer.attn.sinks)
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-2
    model = minimlx.load_model(dense, dtype="float32")
    model.layers[0].attn.window = None  # and the window hides the older tokens
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-1


def test_gpt_oss_sliding_layers_keep_only_the_window(gpt_oss):
    dense, *_, ids = gpt_oss
    model = minimlx.load_model(dense, dtype="float32")
    cache, sliding = model.make_cache(), []
    for t in range(16):
        mx.eval(model(mx.array(ids[:, t : t + 1]), cache))
        sliding.append(cache[0].nbytes)
    per_position = 2 * 2 * 2 * 16 * 4  # keys and values, 2 rows, 2 kv heads, head_dim 16, float32
    assert sliding[2:] == [3 * per_position] * 14  # window 4: each token sees itself and the 3 before it


def test_gpt_oss_transformers_4_layout(gpt_oss, tmp_path):
    """The published configs' layout: rope_theta + rope_scaling (yarn), torch_dtype."""
    dense, reference, *_, ids = gpt_oss
    folder = shutil.copytree(dense, tmp_path / "v4")
    to_v4_layout(folder)
    model = minimlx.load_model(folder, dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def test_gpt_oss_mxfp4_matches_transformers_dequantized(gpt_oss):
    """The published MXFP4 layout, kept packed (MLX's mxfp4 gathered matmuls) or dequantized to float32."""
    *_, mxfp4, reference, ids = gpt_oss
    packed = minimlx.load_model(mxfp4, dtype="quantized")
    experts = packed.layers[0].ffn.experts
    assert isinstance(experts.gate_proj, QuantizedExpertLinear) and experts.gate_proj.mode == "mxfp4"
    assert experts.gate_proj.weight.dtype == mx.uint32 and experts.gate_proj.scales.dtype == mx.uint8
    full, cached = close(packed, ids, reference)
    assert full <= 1e-4 and cached <= 1e-4
    dequantized = minimlx.load_model(mxfp4, dtype="float32")
    assert dequantized.layers[0].ffn.experts.gate_proj.weight.dtype == mx.float32
    assert relative_error(np.array(dequantized(mx.array(ids))), reference) <= 1e-4


def test_gpt_oss_mxfp4_blocks_that_do_not_fit_are_refused_in_one_line(gpt_oss, tmp_path):
    *_, mxfp4, _, _ = gpt_oss
    folder = shutil.copytree(mxfp4, tmp_path / "bad")
    tensors = mx.load(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name][..., :-1]  # a block short: one scale for 64 features
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=r"layers.1.ffn.experts.(gate|up)_proj.weight .*mxfp4 quantization"):
        minimlx.load_model(folder)


def test_gpt_oss_mxfp4_converts_to_mlx_lm_layout_kept_packed(gpt_oss, tmp_path):
    """`minimlx convert` keeps the experts in mxfp4 under mlx-lm's names; a folder that also holds affine 8-bit
    attention (per-module entries, as mlx-lm writes mixed folders) loads with each module in its own mode."""
    from mlx_lm_reference import mlx_lm_logits, save_tokenizer

    *_, mxfp4, reference, ids = gpt_oss
    source = shutil.copytree(mxfp4, tmp_path / "source")
    save_tokenizer(source)
    converted = minimlx.convert(source, tmp_path / "mlx")
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert relative_error(np.array(minimlx.load_model(converted, dtype="quantized")(mx.array(ids))), reference) <= 1e-4

    tensors = mx.load(str(converted / "model.safetensors"))
    for name in [n for n in tensors if ".self_attn." in n and n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        tensors[name], tensors[f"{module}.scales"], tensors[f"{module}.biases"] = mx.quantize(tensors[name], 64, 8)
        config["quantization"][module] = {"group_size": 64, "bits": 8, "mode": "affine"}
    mx.save_safetensors(str(converted / "model.safetensors"), tensors)
    # mlx-lm reads these folders but not yarn's `truncate: false` (which real gpt-oss configs have): compare without it
    config["rope_scaling"]["truncate"] = True
    (converted / "config.json").write_text(json.dumps(config))
    expected = np.array(mlx_lm_logits(converted, ids))
    for dtype in ("quantized", "float32"):
        assert relative_error(np.array(minimlx.load_model(converted, dtype=dtype)(mx.array(ids))), expected) <= 1e-4
