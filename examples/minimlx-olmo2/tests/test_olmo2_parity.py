"""The plugin against the reference: a random OLMo-2 from transformers, loaded through minimlx.

Run with `pytest examples/minimlx-olmo2` after `pip install ./examples/minimlx-olmo2`.
"""

import os

import mlx.core as mx
import numpy as np
import pytest

import minimlx  # noqa: I001  (first: it puts a fast BLAS under MLX before mlx.core loads)
from minimlx.archs import registrations


def need(module: str):
    """Import a module the test needs; in CI (env CI set) its absence fails instead of skipping."""
    return __import__(module) if os.environ.get("CI") else pytest.importorskip(module)


plugin = need("minimlx_olmo2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' Olmo2ForCausalLM built from the plugin's example config with random weights, and its folder."""
    torch, transformers = need("torch"), need("transformers")
    torch.manual_seed(0)
    config = {k: v for k, v in plugin.Olmo2Config.example_config.items() if k != "model_type"}
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**config)).eval()
    with torch.no_grad():  # transformers starts norms at exactly 1: randomise every tensor so each one matters
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    folder = tmp_path_factory.mktemp("olmo2")
    model.save_pretrained(folder)
    return model, folder


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    torch = need("torch")
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def relative_error(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_registered_by_its_package():
    (olmo2,) = [r for r in registrations() if r.model_type == "olmo2"]
    assert olmo2.plugin is plugin.Olmo2Config
    assert olmo2.source == "minimlx-olmo2"


def test_logits_match_transformers(reference):
    model, folder = reference
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 16))
    logits = minimlx.load_model(folder)(mx.array(ids))
    assert relative_error(logits, reference_logits(model, ids)) <= 1e-4


def test_decoding_through_the_cache_matches_transformers(reference):
    model, folder = reference
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(1, 12))
    ours = minimlx.load_model(folder)
    cache = ours.make_cache()
    steps = [ours(mx.array(ids[:, :8]), cache)] + [ours(mx.array(ids[:, i : i + 1]), cache) for i in range(8, 12)]
    assert relative_error(mx.concatenate(steps, axis=1), reference_logits(model, ids)) <= 1e-4
