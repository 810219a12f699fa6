"""The compiled decode step gives the greedy tokens of eager decoding (SmolLM2 and a tiny random model)."""

import mlx.core as mx
import numpy as np
import pytest
from models import TINY_LLAMA
from reference import save_reference

import minimlx
from minimlx.decode import SamplingSettings, encode_prompt, generate_tokens, stream_generate
from minimlx.decode.compiled import CompiledDecoder, FixedKVCache, compiled_decoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_reference(folder, "LlamaConfig", **TINY_LLAMA)
    return minimlx.load_model(folder)


def eager_ids(model, prompt, count):
    return list(generate_tokens(model, prompt, model.make_cache(), SamplingSettings(count)))


@pytest.mark.slow
def test_compiled_smollm2_greedy_tokens_equal_eager(smollm2):
    model, tokenizer = smollm2
    prompt = encode_prompt(tokenizer, "Write a haiku about the sea.")
    compiled = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    assert isinstance(compiled_decoder(model), CompiledDecoder)
    assert compiled == eager_ids(model, prompt, 24)[: len(compiled)]


def test_compiled_tiny_model_across_capacity_growth(tiny, monkeypatch):
    """Capacity grows every 8 tokens here, so the step is traced anew several times; the logits and tokens
    stay those of the eager model over a growing cache."""
    monkeypatch.setattr(FixedKVCache, "step", 8)
    decoder = CompiledDecoder(tiny)
    prompt = np.random.default_rng(0).integers(0, 96, size=5).tolist()
    compiled = list(generate_tokens(decoder, prompt, decoder.make_cache(), SamplingSettings(40)))
    assert compiled == eager_ids(tiny, prompt, 40)
    cache, eager_cache = decoder.make_cache(), tiny.make_cache()
    for ids in ([prompt], [[7]], [[9]]):
        ours, theirs = decoder(mx.array(ids), cache), tiny(mx.array(ids), eager_cache)
        assert mx.abs(ours - theirs).max().item() < 1e-5
    assert cache[0].offset == 7 and cache[0].keys.shape[2] == 8


def test_fixed_cache_trims_back(tiny):
    """After a trim the next token overwrites the forgotten one: the logits equal a cache that never held it."""
    decoder = CompiledDecoder(tiny)
    cache, clean = decoder.make_cache(), decoder.make_cache()
    decoder(mx.array([[1, 2, 3, 4]]), cache)
    decoder(mx.array([[1, 2, 3]]), clean)
    for c in cache:
        c.trim(1)
    assert cache[0].offset == 3
    assert mx.abs(decoder(mx.array([[5]]), cache) - decoder(mx.array([[5]]), clean)).max().item() < 1e-5
