"""Activation capture: the recorded stream adds up, costs nothing when off, and reports the routing and the
attention weights used."""

import sys

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_map
from traced_models import CONFIGS, IDS, VOCAB, random_model

import minimlx
from minimlx.anatomy.attention import attention_pattern
from minimlx.anatomy.trace import BLOCK_ACTIVATIONS, activation_names
from minimlx.cli import main
from minimlx.core import Attention, Recorder, RoPE
from minimlx.errors import InvalidSettingError


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def traced(request):
    model = random_model(request.param)
    return model, minimlx.trace(model, IDS, attention=True)


def test_every_activation_is_recorded(traced):
    model, values = traced
    assert list(values) == activation_names(model, attention=True)
    assert values["layers.0.attn_weights"].shape == (1, model.layers[0].attn.heads, IDS.shape[1], IDS.shape[1])
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
    assert not any(name.endswith(("queries", "keys", "attn_weights")) for name in everything)  # only when asked
    with_attention = minimlx.trace(model, IDS, names, attention=True)
    assert list(with_attention)[:3] == names and len(with_attention) == 3 + 3 * len(model.layers)
    alone = minimlx.trace(model, IDS, ["layers.1.attn_weights"])
    assert mx.array_equal(with_attention["layers.1.attn_weights"], alone["layers.1.attn_weights"])


def recomputed_weights(queries: mx.array, keys: mx.array) -> mx.array:
    """softmax(q k^T / sqrt(d)) under the causal mask, each kv head repeated for the query heads that share it."""
    heads, tokens = queries.shape[1], queries.shape[2]
    keys = mx.repeat(keys, heads // keys.shape[1], axis=1)
    scores = (queries @ keys.swapaxes(-1, -2)) * queries.shape[-1] ** -0.5
    return mx.softmax(mx.where(mx.tril(mx.ones((tokens, tokens), dtype=mx.bool_)), scores, -mx.inf), axis=-1)


def check_attention(model, values, atol: float):
    """Every head's weights sum to 1 over the tokens it sees (none after itself), equal a recomputation from the
    recorded queries and keys, and, for ordinary attention, give the block's attention output."""
    for i, layer in enumerate(model.layers):
        weights = values[f"layers.{i}.attn_weights"]
        tokens = weights.shape[-1]
        assert mx.allclose(weights.sum(axis=-1), mx.ones(weights.shape[:-1]), atol=1e-5)
        assert mx.all(mx.where(mx.triu(mx.ones((tokens, tokens)), k=1) > 0, weights, 0) == 0)
        recomputed = recomputed_weights(values[f"layers.{i}.queries"], values[f"layers.{i}.keys"])
        assert mx.allclose(weights, recomputed, atol=1e-5)
        if isinstance(layer.attn, Attention):
            attn = layer.attn
            x = layer.attn_norm(values[f"layers.{i}.resid_pre"])
            v = attn.v_proj(x).reshape(*x.shape[:2], attn.kv_heads, -1).transpose(0, 2, 1, 3)
            read = mx.repeat(v, attn.heads // attn.kv_heads, axis=1)
            out = attn.o_proj((weights @ read).transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))
            assert mx.allclose(out, values[f"layers.{i}.attn_out"], atol=atol)


def test_attention_weights_are_the_ones_used(traced):
    model, values = traced
    check_attention(model, values, atol=1e-4)


PROMPT = "The capital of France is"


@pytest.mark.slow
def test_smollm2_attention_weights(smollm2):
    """On SmolLM2 (30 layers, 9 query heads sharing 3 key/value heads): the acceptance checks, and the
    recorded queries and keys are the projections after RoPE."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPT)
    values = minimlx.trace(model, ids, attention=True)
    check_attention(model, values, atol=1e-4)
    attn, x = model.layers[5].attn, model.layers[5].attn_norm(values["layers.5.resid_pre"])
    q = attn.q_proj(x).reshape(1, len(ids), attn.heads, -1).transpose(0, 2, 1, 3)
    assert values["layers.5.queries"].shape == (1, 9, len(ids), 64)
    assert values["layers.5.keys"].shape == (1, 3, len(ids), 64)
    assert mx.allclose(values["layers.5.queries"], attn.rope(q, 0), atol=1e-5)
    pattern = attention_pattern(model, tokenizer, PROMPT, layer=5)
    assert pattern.heads == 9 and pattern.head is None
    assert mx.allclose(mx.array(pattern.weights), values["layers.5.attn_weights"][0].mean(axis=0), atol=1e-6)


@pytest.mark.slow
def test_attention_command_prints_the_pattern_and_draws_it(smollm2, tmp_path):
    model, tokenizer = smollm2
    png = tmp_path / "attention.png"
    arguments = ["attention", "smollm2-135m", PROMPT, "--layer", "3", "--head", "2", "--plot", str(png)]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    title, header, *rows = result.output.splitlines()
    assert title == "layer 3, head 2: % of each row's attention on each token up to it"
    assert header.split() == ["'The'", "'", "capital'", "'", "of'", "'", "France'", "'", "is'"]
    expected = attention_pattern(model, tokenizer, PROMPT, layer=3, head=2).weights
    assert len(rows) == len(expected) == 5
    for t, (row, weights) in enumerate(zip(rows, expected)):
        shown = [float(cell) for cell in row[row.rindex("'") + 1 :].split()]
        assert shown == pytest.approx([100 * w for w in weights[: t + 1]], abs=0.051)
        assert sum(shown) == pytest.approx(100, abs=0.3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_attention_command_errors_are_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    result = CliRunner().invoke(main, ["attention", "smollm2-135m", PROMPT, "--plot", "out.png"])
    assert result.exit_code == 2 and "pip install 'minimlx[plot]'" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_attention_pattern_checks_layer_and_head(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(InvalidSettingError, match="layer must be between 0 and 29"):
        attention_pattern(model, tokenizer, PROMPT, layer=30)
    with pytest.raises(InvalidSettingError, match="head must be between 0 and 8"):
        attention_pattern(model, tokenizer, PROMPT, head=9)


@pytest.mark.parametrize("logit_cap", [None, 5.0])
def test_windowed_and_sink_attention_are_recorded(logit_cap):
    """A sliding window hides the tokens more than `window` back, soft-capping bends the scores, and each head's
    sink takes its share: the recorded rows sum to 1 minus that share and give the layer's output."""
    mx.random.seed(1)
    window, tokens = 3, 7
    attn = Attention(32, 4, 2, 8, rope=RoPE(8), window=window, sinks=True, logit_cap=logit_cap)
    attn.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.5, attn.parameters()))
    x = mx.random.normal((1, tokens, 32))
    recorder = Recorder()
    out = attn(x, None, recorder)
    weights, queries, keys = (recorder.values[name] for name in ("attn_weights", "queries", "keys"))
    scores = (queries @ mx.repeat(keys, 2, axis=1).swapaxes(-1, -2)) * 8**-0.5
    if logit_cap is not None:
        scores = logit_cap * mx.tanh(scores / logit_cap)
    position = mx.arange(tokens)
    seen = (position <= position[:, None]) & (position > position[:, None] - window)
    sinks = mx.broadcast_to(attn.sinks[None, :, None, None], (1, 4, tokens, 1))
    shares = mx.softmax(mx.concatenate([sinks, mx.where(seen, scores, -mx.inf)], axis=-1), axis=-1)
    assert mx.allclose(weights, shares[..., 1:], atol=1e-5)
    assert mx.all(mx.where(seen, 0, weights) == 0)
    assert mx.allclose(weights.sum(axis=-1), 1 - shares[..., 0], atol=1e-5) and shares[..., 0].mean() > 0.05
    values = mx.repeat(attn.v_proj(x).reshape(1, tokens, 2, 8).transpose(0, 2, 1, 3), 2, axis=1)
    assert mx.allclose(attn.o_proj((weights @ values).transpose(0, 2, 1, 3).reshape(1, tokens, -1)), out, atol=1e-5)
