"""Activation capture: the recorded stream adds up, costs nothing when off, and reports the routing used."""

import mlx.core as mx
import pytest
from mlx.utils import tree_map

import minimlx
from minimlx.anatomy.trace import BLOCK_ACTIVATIONS, activation_names
from minimlx.errors import InvalidSettingError
from minimlx.archs import build_model

VOCAB = 64
CONFIGS = {
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    "llama": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    ),
}


def random_model(model_type: str):
    model = build_model(CONFIGS[model_type])
    mx.random.seed(0)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    mx.eval(model.parameters())
    return model


IDS = mx.array([[5, 17, 3, 42, 8, 8, 60, 1, 29, 11]])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def traced(request):
    model = random_model(request.param)
    return model, minimlx.trace(model, IDS)


def test_every_activation_is_recorded(traced):
    model, values = traced
    assert list(values) == activation_names(model)
    assert values["logits"].shape == (1, IDS.shape[1], VOCAB)


def test_capture_does_not_change_the_output(traced):
    model, values = traced
    assert mx.array_equal(values["logits"], model(IDS))


def test_residual_stream_adds_up(traced):
    model, values = traced
    assert mx.array_equal(values["embed"], values["layers.0.resid_pre"])
    for i in range(len(model.layers)):
        layer = {what: values[f"layers.{i}.{what}"] for what in BLOCK_ACTIVATIONS}
        assert mx.allclose(layer["resid_pre"] + layer["attn_out"] + layer["mlp_out"], layer["resid_post"], atol=1e-5)
        assert mx.allclose(layer["resid_pre"] + layer["attn_out"], layer["resid_mid"], atol=1e-5)
        if i + 1 < len(model.layers):
            assert mx.array_equal(layer["resid_post"], values[f"layers.{i + 1}.resid_pre"])
    final = values[f"layers.{len(model.layers) - 1}.resid_post"]
    assert mx.array_equal(values["final_norm"], model.norm(final))


def test_reported_routing_is_the_routing_used(traced):
    model, values = traced
    moe_layers = [i for i, layer in enumerate(model.layers) if hasattr(layer.ffn, "route")]
    if not moe_layers:
        assert not any("expert" in name for name in values)
        return
    assert moe_layers == [1, 2]  # the first layer is dense in both configs
    for i in moe_layers:
        ffn = model.layers[i].ffn
        indices, weights = values[f"layers.{i}.expert_indices"], values[f"layers.{i}.expert_weights"]
        assert indices.shape == weights.shape == (1, IDS.shape[1], ffn.experts_per_token)
        assert mx.all((indices >= 0) & (indices < ffn.num_experts))
        for row in indices.reshape(-1, ffn.experts_per_token).tolist():
            assert len(set(row)) == len(row)
        x = model.layers[i].ffn_norm(values[f"layers.{i}.resid_mid"])
        rebuilt = (ffn.experts(x, indices) * weights[..., None]).sum(axis=-2)
        if "shared_experts" in ffn:
            rebuilt = rebuilt + ffn.shared_experts(x)
        assert mx.allclose(rebuilt, values[f"layers.{i}.mlp_out"], atol=1e-4)


def test_names_select_activations():
    model = random_model("qwen3_moe")
    everything = minimlx.trace(model, IDS)
    names = ["layers.2.expert_indices", "layers.0.attn_out", "logits"]
    some = minimlx.trace(model, IDS[0], names)
    assert list(some) == names
    for name in names:
        assert mx.array_equal(some[name], everything[name])
    with pytest.raises(InvalidSettingError, match="layers.0.expert_indices"):
        minimlx.trace(model, IDS, ["layers.0.expert_indices"])  # layer 0 is dense
