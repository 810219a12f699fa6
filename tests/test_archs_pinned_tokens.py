"""Greedy token ids pinned for every built-in family: what a refactor must leave exactly as it is.

Each family's tiny example config is built with seeded random weights (no reference library involved), saved and
loaded as a folder (on the CPU: with its CPU forms), fed a seeded 20-token prompt and decoded greedily for 12 tokens
through the engine, so that windows roll over, caches grow and the compiled step runs. SmolLM2's answer is pinned
on both CPU paths (its default load and float32).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import minimlx
from minimlx.archs.registry import build, plugin_config, registrations
from minimlx.decode import SamplingSettings, generate_tokens, stream_generate
from minimlx.errors import UnsupportedArchitectureError

PINNED = {
    "deepseek": [32, 32, 32, 32, 32, 32, 38, 38, 38, 38, 38, 38],
    "deepseek_v2": [42, 48, 34, 35, 10, 29, 14, 40, 29, 42, 48, 34],
    "deepseek_v3": [56, 53, 30, 30, 30, 30, 30, 30, 6, 55, 4, 4],
    "gemma2": [1, 1, 56, 56, 56, 56, 56, 56, 56, 56, 56, 56],
    "gemma3": [60, 60, 60, 60, 60, 60, 60, 60, 60, 60, 60, 60],
    "gemma3_text": [60, 60, 60, 60, 60, 60, 60, 60, 60, 60, 60, 60],
    "gemma4": [45, 51, 51, 45, 45, 50, 50, 50, 50, 50, 50, 50],
    "gemma4_text": [45, 51, 51, 45, 45, 50, 50, 50, 50, 50, 50, 50],
    "glm4": [25, 52, 29, 42, 53, 53, 62, 25, 58, 54, 24, 53],
    "gpt2": [29, 51, 29, 29, 29, 29, 29, 51, 29, 29, 29, 51],
    "gpt_oss": [2, 2, 44, 16, 2, 44, 16, 45, 16, 26, 52, 16],
    "kimi_k2": [56, 53, 30, 30, 30, 30, 30, 30, 6, 55, 4, 4],
    "llama": [34, 34, 34, 34, 34, 34, 34, 18, 34, 18, 34, 18],
    "mistral": [34, 34, 34, 34, 18, 34, 18, 16, 24, 32, 18, 18],
    "mixtral": [30, 48, 7, 46, 30, 30, 46, 6, 6, 30, 48, 7],
    "phi3": [34, 34, 34, 34, 34, 18, 34, 18, 34, 18, 34, 18],
    "qwen2": [40, 44, 40, 44, 40, 44, 40, 44, 40, 44, 40, 44],
    "qwen2_5_vl": [40, 44, 40, 44, 40, 44, 40, 44, 40, 44, 40, 44],  # text alone: Qwen2's positions
    "qwen2_vl": [40, 44, 40, 44, 40, 44, 40, 44, 40, 44, 40, 44],
    "qwen2_moe": [25, 10, 53, 35, 35, 53, 35, 15, 15, 15, 15, 15],
    "qwen3": [38, 24, 37, 16, 54, 37, 16, 54, 37, 16, 54, 37],
    "qwen3_moe": [7, 30, 33, 53, 37, 53, 37, 53, 37, 53, 37, 53],
    "smollm3": [34, 34, 34, 34, 34, 34, 34, 18, 34, 18, 34, 18],
    "idefics3": [34, 34, 34, 34, 34, 34, 34, 18, 34, 18, 34, 18],
    "smolvlm": [34, 34, 34, 34, 34, 34, 34, 18, 34, 18, 34, 18],
    "deepseek_v32": [6, 63, 56, 40, 60, 24, 30, 30, 42, 35, 33, 30],
    "glm4_moe": [30, 63, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53],
    "llama4": [42, 54, 54, 6, 61, 30, 36, 30, 30, 25, 25, 25],
    "llama4_text": [42, 54, 54, 6, 61, 30, 36, 30, 30, 25, 25, 25],
    "minimax_m2": [36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36],
    "ministral3": [46, 60, 10, 10, 10, 10, 60, 32, 61, 32, 10, 5],
    "mistral3": [14, 24, 24, 24, 24, 24, 24, 24, 24, 24, 44, 44],
    "mistral4": [24, 29, 61, 24, 23, 41, 21, 24, 51, 46, 12, 10],
    "olmo3": [56, 56, 34, 56, 54, 47, 32, 56, 35, 56, 56, 34],
    "granitemoehybrid": [41, 25, 14, 35, 5, 29, 13, 10, 42, 39, 19, 25],
    "lfm2": [16, 36, 15, 27, 36, 12, 60, 0, 68, 23, 59, 32],
    "qwen3_5": [12, 34, 9, 30, 82, 86, 57, 61, 27, 53, 13, 71],
    "qwen3_5_moe": [12, 36, 11, 48, 88, 17, 18, 26, 87, 43, 79, 65],
    "qwen3_5_moe_text": [12, 36, 11, 48, 88, 17, 18, 26, 87, 43, 79, 65],
    "qwen3_5_text": [12, 34, 9, 30, 82, 86, 57, 61, 27, 53, 13, 71],
    "qwen3_next": [12, 36, 11, 48, 88, 17, 18, 26, 87, 43, 79, 65],
    "qwen3_vl": [38, 24, 37, 16, 54, 37, 16, 54, 37, 16, 54, 37],
    "qwen3_vl_moe": [7, 30, 33, 53, 37, 53, 37, 53, 37, 53, 11, 56],
}
GEMMA_SPREAD = 0.1  # their soft-capped logits saturate (every token tied at the cap) with wider weights
SMOLLM2_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris."


def seeded_model(model_type: str, folder):
    """The family's example model with weights drawn from N(0, spread) in the order of their sorted names, saved as
    an MLX folder and loaded from it as a user's would be."""
    plugin = next(r.plugin for r in registrations() if r.model_type == model_type)
    config = dict(plugin.example_config, model_type=model_type)
    arch = plugin_config(config, "example")
    spread = GEMMA_SPREAD if model_type.startswith("gemma") else 0.3
    rng = np.random.default_rng(0)
    params = sorted(tree_flatten(build(arch).parameters()), key=lambda item: item[0])
    weights = {name: mx.array(rng.normal(0, spread, p.shape).astype(np.float32)) for name, p in params}
    try:
        exported = arch.export_weights(weights)
    except UnsupportedArchitectureError:  # families whose MLX-folder names are not mapped yet: the built model
        model = build(arch)
        model.load_weights(list(weights.items()))
        return model, arch
    mx.save_safetensors(str(folder / "model.safetensors"), exported)
    (folder / "config.json").write_text(json.dumps(arch.export_config(config)))  # the config written with them
    return minimlx.load_model(folder), arch


def test_every_built_in_family_is_pinned():
    built_in = {r.model_type for r in registrations() if r.source == "built-in"}
    assert built_in == set(PINNED)


@pytest.mark.parametrize("model_type", sorted(PINNED))
def test_greedy_tokens_stay_pinned(model_type, tmp_path):
    model, arch = seeded_model(model_type, tmp_path)
    prompt = np.random.default_rng(1).integers(0, arch.vocab_size, 20).tolist()
    assert list(generate_tokens(model, prompt, model.make_cache(), SamplingSettings(12))) == PINNED[model_type]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_smollm2_answer_stays_pinned(dtype):
    model, tokenizer = minimlx.load("smollm2-135m", dtype=dtype)
    tokens = [r.token for r in stream_generate(model, tokenizer, "What is the capital of France?", max_tokens=16)]
    assert tokens == SMOLLM2_ANSWER
