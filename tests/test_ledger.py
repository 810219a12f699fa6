"""The parameter ledger: published totals from the presets, loaded weights against configs, quantized counts."""

import json
import subprocess
import sys

import mlx.nn as nn
import pytest
from click.testing import CliRunner

import minimlx
from minimlx.anatomy import ledger, presets
from minimlx.cli import main
from reference import require, save_reference

PUBLISHED_TOTALS = {
    "gpt2": 124_439_808,
    "llama3-8b": 8_030_261_248,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "qwen3-235b-a22b": 235_093_634_560,
    "deepseek-v3": 671_026_419_200,
    "deepseek-v2-lite": 15_706_484_224,
}


def test_presets_are_the_published_models():
    assert presets() == sorted(PUBLISHED_TOTALS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_preset_total(name):
    assert ledger(name).total == PUBLISHED_TOTALS[name]


def test_gpt2_components_and_percentages():
    result = CliRunner().invoke(main, ["anatomy", "gpt2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["total"] == out["active"] == 124_439_808
    assert out["tied_head"] is True
    assert out["components"] == {
        "token_embedding": 38_597_376,
        "position_embedding": 786_432,
        "attention": 28_348_416,
        "ffn": 56_669_184,
        "norms": 38_400,
    }
    table = CliRunner().invoke(main, ["anatomy", "gpt2"]).output
    rows = {line[:20].strip(): line for line in table.splitlines()}
    for component, percent in [("token embedding", "31.0%"), ("position embedding", "0.6%"),
                               ("attention", "22.8%"), ("FFN", "45.5%")]:
        assert percent in rows[component]
    assert "tied" in rows["lm_head"]


def test_llama3_8b_matches_the_seed_walkthrough():
    entry = ledger("llama3-8b")
    assert entry.components["token_embedding"] == entry.components["lm_head"] == 525_336_576
    assert not entry.tied_head
    assert entry.layers[0] == {"attention": 41_943_040, "ffn": 176_160_768, "norms": 8_192}
    assert len(entry.layers) == 32 and all(layer == entry.layers[0] for layer in entry.layers)


def test_moe_router_bias_and_active_parameters():
    v3 = ledger("deepseek-v3")
    assert v3.components["router"] == 58 * (256 * 7168 + 256)  # 58 MoE layers, correction bias included
    assert v3.components["shared_experts"] == 58 * 3 * 7168 * 2048
    routed = v3.components["routed_experts"]
    assert routed == 58 * 256 * 3 * 7168 * 2048
    assert v3.active == v3.total - routed + routed * 8 // 256 == 37_552_297_472
    lite = ledger("deepseek-v2-lite")
    assert lite.components["router"] == 26 * 64 * 2048  # greedy routing: no correction bias
    assert ledger("qwen3-235b-a22b").active == 22_190_763_520
    assert "router" not in ledger("qwen3-8b").components


PEAK_MEMORY_SCRIPT = r"""
import re, resource, time
start = time.perf_counter()
import mlx.core as mx
from minimlx.anatomy import ledger
total = ledger("deepseek-v3").total
seconds = time.perf_counter() - start
try:  # Linux: this program's own peak (ru_maxrss would include the parent forked before exec)
    peak_kb = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read())[1])
except OSError:  # macOS: ru_maxrss, in bytes
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(total, seconds, peak_kb, mx.get_peak_memory())
"""


def test_deepseek_v3_ledger_is_fast_and_small():
    """A fresh process imports minimlx and counts 671B parameters in under 3 s and 500 MB, allocating no weight."""
    run = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT], capture_output=True, text=True, check=True)
    total, seconds, peak_kb, mlx_peak_bytes = run.stdout.split()
    assert int(total) == 671_026_419_200
    assert float(seconds) < 3
    assert int(peak_kb) < 500 * 1024
    assert int(mlx_peak_bytes) < 2**20


def test_compare_table():
    result = CliRunner().invoke(main, ["anatomy", "--compare", "llama3-8b", "qwen3-235b-a22b", "deepseek-v3"])
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split() == ["model", "layers", "d_model", "heads", "experts", "total", "active"]
    assert rows[0].split() == ["llama3-8b", "32", "4096", "32", "-", "8.03B", "8.03B"]
    assert rows[1].split() == ["qwen3-235b-a22b", "94", "4096", "64", "128", "top", "8", "235.09B", "22.19B"]
    assert rows[2].split() == ["deepseek-v3", "61", "7168", "128", "256", "top", "8", "+shared", "671.03B", "37.55B"]


def test_unknown_model_is_one_line_error():
    result = CliRunner().invoke(main, ["anatomy", "no-such-model-or-folder"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output


VOCAB = 64
ARCHITECTURES = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
    "llama": ("LlamaConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )),
    "qwen3": ("Qwen3Config", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False,
    )),
    "deepseek_v2": ("DeepseekV2Config", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="greedy", tie_word_embeddings=False,
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False,
    )),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    config_class, config = ARCHITECTURES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_reference(folder, config_class, **config)
    return request.param, folder


def test_loaded_weights_give_the_config_ledger(checkpoint):
    _, folder = checkpoint
    from_weights = ledger(minimlx.load_model(folder)).to_dict(per_layer=True)
    from_config = ledger(folder).to_dict(per_layer=True)
    assert from_weights == from_config
    assert from_weights["total"] == reference_count(folder)


def reference_count(folder) -> int:
    """Parameters of the transformers model, plus the routers' correction biases (kept there as buffers)."""
    transformers = require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    biases = [b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")]
    return sum(p.numel() for p in [*model.parameters(), *biases])


def test_quantized_model_counts_logical_parameters(checkpoint):
    _, folder = checkpoint
    model = minimlx.load_model(folder)
    before = ledger(model)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    after = ledger(model)
    assert after.components == before.components and after.layers == before.layers
    assert after.active == before.active
    quantized = [kind for kind in before.components if kind not in ("norms", "router", "routed_experts")]
    for kind in quantized:  # 4 bits plus a float32 scale and bias per 32 weights: 6 bits a weight, not 32
        assert after.nbytes[kind] < before.nbytes[kind] / 3
