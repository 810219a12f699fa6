"""Speculative decoding: greedy tokens equal plain decoding's; sampling keeps the model's distribution."""

import mlx.core as mx
import numpy as np
import pytest
from models import TINY_LLAMA, Ids
from reference import save_reference

import minimlx
from minimlx.decode import SamplingSettings, stream_generate
from minimlx.decode.speculative import PromptLookup, Verifier
from minimlx.errors import InvalidSettingError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    models = []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"llama{seed}")
        save_reference(folder, "LlamaConfig", seed=seed, **TINY_LLAMA)
        models.append(minimlx.load_model(folder))
    return models


def tokens(model, tokenizer, prompt, **settings):
    return [r.token for r in stream_generate(model, tokenizer, prompt, **settings)]


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    lookup = PromptLookup(3)
    assert lookup.draft([5, 6, 7, 8, 9, 1, 6, 7], 3, None) == ([8, 9, 1], None)
    assert lookup.draft([5, 6, 7, 8, 9, 1, 6, 7], 2, None) == ([8, 9], None)
    assert lookup.draft([1, 2, 3, 1, 2, 4, 1, 2], 3, None) == ([4, 1, 2], None)  # the latest occurrence
    assert lookup.draft([1, 2, 3, 4], 3, None) == ([], None)


def test_greedy_tiny_model_equals_plain_decoding(tiny):
    model, other = tiny
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 96, size=30).tolist()
    prompt += prompt[:12]  # something to look up
    plain = tokens(model, Ids(), prompt, max_tokens=40)
    looked_up = list(stream_generate(model, Ids(), prompt, max_tokens=40, prompt_lookup=4))
    assert [r.token for r in looked_up] == plain
    assert looked_up[-1].accepted_tokens > 0
    assert tokens(model, Ids(), prompt, max_tokens=40, draft_model=other, draft_tokens=3) == plain
    drafted_by_itself = list(stream_generate(model, Ids(), prompt, max_tokens=40, draft_model=model, draft_tokens=3))
    assert [r.token for r in drafted_by_itself] == plain
    assert drafted_by_itself[-1].accepted_tokens == drafted_by_itself[-1].drafted_tokens > 0


@pytest.mark.slow
def test_greedy_smollm2_prompt_lookup_equals_plain_decoding(smollm2):
    model, tokenizer = smollm2
    prompt = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."
    plain = tokens(model, tokenizer, prompt, max_tokens=24)
    looked_up = list(stream_generate(model, tokenizer, prompt, max_tokens=24, prompt_lookup=6))
    assert [r.token for r in looked_up] == plain
    assert looked_up[-1].accepted_tokens >= 8


@pytest.mark.slow
def test_sampling_keeps_the_model_distribution(tiny):
    """The first token a round emits, over 3000 seeded rounds, is distributed as the model's filtered p:
    for a sampled draft model's drafts and for prompt lookup's certain ones."""
    model, other = tiny
    prompt = mx.array([np.random.default_rng(1).integers(0, 96, size=12).tolist()])
    verifier = Verifier(SamplingSettings(temperature=1.0, top_p=1.0, top_k=6, min_p=0.0), mx.random.key(0))
    logits = model(prompt)[0, -3:]  # the model's logits at the last token and two drafted positions
    p = np.array(verifier.probabilities(logits[:1])[0])
    q = verifier.probabilities(other(prompt)[0, -2:] * 0.5)  # a broader, different draft distribution
    draws = 3000
    for certain in (False, True):
        counts = np.zeros(96)
        keys = mx.random.split(mx.random.key(1), draws)
        for key in keys:
            drafts = mx.random.categorical(mx.log(q), key=key).tolist()
            accepted, token = verifier.verify(logits, drafts, None if certain else q)
            counts[drafts[0] if accepted else token] += 1
        assert 0.5 * np.abs(counts / draws - p).sum() < 0.04, certain


def test_speculation_refuses_what_it_cannot_do(tiny):
    model, other = tiny
    with pytest.raises(InvalidSettingError, match="choose one drafter"):
        tokens(model, Ids(), [1, 2, 3], draft_model=other, prompt_lookup=2)
    with pytest.raises(InvalidSettingError, match="repetition penalty"):
        tokens(model, Ids(), [1, 2, 3], prompt_lookup=2, repetition_penalty=1.2)
