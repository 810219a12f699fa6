"""The parameter ledger: published totals from the presets, loaded weights against configs, quantized counts."""

import json
import subprocess
import sys

import mlx.nn as nn
import pytest
from click.testing import CliRunner
from reference import require, save_reference

import minimlx
from minimlx.anatomy import ledger, preset, presets
from minimlx.cli import main

PUBLISHED_TOTALS = {
    "gpt2": 124_439_808,
    "llama3-8b": 8_030_261_248,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "qwen3-235b-a22b": 235_093_634_560,
    "deepseek-v3": 671_026_419_200,
    "deepseek-v2-lite": 15_706_484_224,
    "kimi-k2": 1_026_408_232_448,
    "gpt-oss-120b": 116_829_156_672,
    "gpt-oss-20b": 20_914_757_184,
    "glm-4-9b": 9_400_279_040,
    "gemma-3-12b": 12_187_325_040,  # the language model, the SigLIP tower and its projector (the Hub's count)
    "gemma-3-27b": 27_432_406_640,
    "llama4-scout": 107_769_861_120,  # the text model: the card's 109B adds the vision tower and projector
    "llama4-maverick": 400_711_848_960,
    "glm-4.5": 352_797_829_024,  # the card's 355B adds the MTP layer, which only speculation reads
    "glm-4.5-air": 106_852_251_264,
    "deepseek-v3.2": 671_877_944_064,  # deepseek-v3 plus 61 lightning indexers; the card's 685B adds the MTP layer
    "gemma-4-31b": 30_697_345_340,  # the card's 30.7B (the text model)
    "qwen3.5-9b": 8_953_803_264,  # the text model, untied
    "qwen3.5-397b-a17b": 396_346_350_336,
    "mistral-small-4": 118_972_826_624,  # the text model of the card's 119B
    "gemma-4-26b-a4b": 25_233_141_790,  # the card's 25.2B, a mixture beside each dense FFN
}
ACTIVE = {  # mixture-of-experts presets: total - routed + routed x experts_per_token / experts
    "qwen3-235b-a22b": 22_190_763_520,
    "deepseek-v3": 37_552_297_472,
    "deepseek-v2-lite": 2_661_150_208,
    "kimi-k2": 32_861_500_928,
    "gpt-oss-120b": 5_711_982_912,  # OpenAI's 5.13B leaves out the embedding (201,088 x 2,880)
    "gpt-oss-20b": 4_187_440_704,  # and 3.61B
    "llama4-scout": 17_172_894_720,
    "llama4-maverick": 17_184_691_200,
    "glm-4.5": 33_632_266_144,  # Z.ai's 32B and 12B leave out the embedding and the lm_head
    "glm-4.5-air": 13_424_129_664,
    "deepseek-v3.2": 38_403_822_336,
    "qwen3.5-397b-a17b": 17_349_040_896,
    "mistral-small-4": 6_632_588_288,
    "gemma-4-26b-a4b": 3_822_530_590,  # the card's 3.8B
}


def test_presets_are_the_published_models():
    assert presets() == sorted(PUBLISHED_TOTALS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_preset_total(name):
    entry = ledger(name)
    assert entry.total == PUBLISHED_TOTALS[name]
    assert entry.active == ACTIVE.get(name, entry.total)


@pytest.fixture(scope="module")
def transformers_meta():
    """preset name -> its transformers model, built on the meta device (no weight allocated)."""
    torch, transformers = require("torch"), require("transformers")

    def build(name):
        config = {key: value for key, value in preset(name).items() if key != "_source"}
        if config["model_type"] == "kimi_k2":  # its remote code (auto_map) is DeepSeek-V3's, which transformers has
            config = {**config, "model_type": "deepseek_v3"}
        config = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):  # a gemma3 config: its image-text model, vision tower included, as minimlx reads it
            if hasattr(config, "vision_config"):
                return transformers.AutoModelForImageTextToText.from_config(config)
            if config.model_type == "mistral4":  # transformers maps no auto class to it
                return transformers.Mistral4ForCausalLM(config)
            return transformers.AutoModelForCausalLM.from_config(config)

    return build


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_preset_counts_are_what_transformers_counts(name, transformers_meta):
    """The exact totals above are transformers' own counts of the configs (with the routers' correction
    biases and Gemma 4's layer scalars, which it keeps as buffers), and the active counts follow from its routed
    experts."""
    model = transformers_meta(name)
    checkpoint_buffers = ("e_score_correction_bias", "layer_scalar")  # buffers the checkpoints hold, as weights
    biases = [b for path, b in model.named_buffers() if path.endswith(checkpoint_buffers)]
    total = sum(p.numel() for p in [*model.parameters(), *biases])
    config = preset(name)
    experts = next((config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in config), None)
    routed = sum(p.numel() for path, p in model.named_parameters() if ".experts." in path)
    chosen = config.get("num_experts_per_tok", config.get("top_k_experts", 0))  # Gemma 4 names it top_k_experts
    active = total - routed + routed * chosen // (experts or 1)
    assert (total, active) == (PUBLISHED_TOTALS[name], ACTIVE.get(name, total))


def test_hybrid_stack_reports_its_attention_heads():
    """Qwen3.5 opens with Gated DeltaNet layers: the shape's heads are those of its first attention layer."""
    assert ledger("qwen3.5-9b").shape["heads"] == 16
    assert ledger("qwen3.5-397b-a17b").shape["heads"] == 32


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
    for component, percent in [
        ("token embedding", "31.0%"),
        ("position embedding", "0.6%"),
        ("attention", "22.8%"),
        ("FFN", "45.5%"),
    ]:
        assert percent in rows[component]
    assert "tied" in rows["lm_head"]


def test_llama3_8b_matches_the_seed_walkthrough():
    entry = ledger("llama3-8b")
    assert entry.components["token_embedding"] == entry.components["lm_head"] == 525_336_576
    assert not entry.tied_head
    assert entry.layers[0] == {"attention": 41_943_040, "ffn": 176_160_768, "norms": 8_192}
    assert len(entry.layers) == 32 and all(layer == entry.layers[0] for layer in entry.layers)
    seed_vocabulary = ledger({**preset("llama3-8b"), "vocab_size": 129_280})  # the seed's sum uses DeepSeek-V3's
    assert seed_vocabulary.components["lm_head"] == 529_530_880  # its "5.3亿"
    assert seed_vocabulary.total == 8_038_649_856  # its "80.4亿"


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


def test_depth_table_is_the_seeds_table():
    result = CliRunner().invoke(main, ["anatomy", "--depth-table"])
    assert result.exit_code == 0, result.output
    header, *rows = [" ".join(line.split()) for line in result.output.splitlines()]
    assert header == "model preset params active width layers heads layers/128 width"
    assert rows == [
        "LLaMA-3-8B llama3-8b 8.03B 8.03B 4096 32 32 1.00",
        "Qwen3-8B qwen3-8b 8.19B 8.19B 4096 36 32 1.12",
        "gpt-oss-120b gpt-oss-120b 116.83B 5.71B 2880 36 64 1.60",
        "GLM-4-9B glm-4-9b 9.40B 9.40B 4096 40 32 1.25",
        "Gemma-3-12B gemma-3-12b 12.19B 12.19B 3840 48 16 1.60",
        "DeepSeek-V3 deepseek-v3 671.03B 37.55B 7168 61 128 1.09",
        "Kimi K2 kimi-k2 1.03T 32.86B 7168 61 64 1.09",
        "Gemma-3-27B gemma-3-27b 27.43B 27.43B 5376 62 32 1.48",
        "Qwen3-32B qwen3-32b 32.76B 32.76B 5120 64 64 1.60",
        "Qwen3-235B-A22B qwen3-235b-a22b 235.09B 22.19B 4096 94 64 2.94",
    ]


def test_unknown_model_is_one_line_error():
    result = CliRunner().invoke(main, ["anatomy", "no-such-model-or-folder"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output


VOCAB = 64
ARCHITECTURES = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="greedy",
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            tie_word_embeddings=False,
        ),
    ),
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
    nn.quantize(
        model,
        group_size=32,
        bits=4,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    after = ledger(model)
    assert after.components == before.components and after.layers == before.layers
    assert after.active == before.active
    quantized = [kind for kind in before.components if kind not in ("norms", "router", "routed_experts")]
    for kind in quantized:  # 4 bits plus a float32 scale and bias per 32 weights: 6 bits a weight, not 32
        assert after.nbytes[kind] < before.nbytes[kind] / 3
