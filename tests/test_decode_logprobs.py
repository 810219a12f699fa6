"""Logprobs and logit_bias on SmolLM2-135M-Instruct: each token's logprob is log_softmax of the model's own logits,
recomputed here by one plain forward pass over the prompt and the answer."""

import math

import mlx.core as mx
import pytest
from models import chat_ids

from minimlx import Constraint, generate, stream_generate
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.errors import InvalidSettingError

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def reference_logprobs(model, prompt: list[int], answer: list[int]) -> mx.array:
    """(len(answer), vocab) log_softmax of the logits that predicted each answer token, in one pass."""
    logits = model(mx.array([prompt + answer]))[0, len(prompt) - 1 : -1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def check(model, prompt, outputs, k):
    """The outputs' logprobs (and k alternatives, sorted, best first) are the reference's within 1e-4."""
    expected = reference_logprobs(model, prompt, [o.token for o in outputs])
    for row, output in zip(expected.tolist(), outputs):
        assert abs(output.logprob - row[output.token]) < 1e-4
        assert len(output.top_logprobs) == k
        values = [value for _, value in output.top_logprobs]
        assert values == sorted(values, reverse=True)
        for token, value in output.top_logprobs:
            assert abs(value - row[token]) < 1e-4
        if k:
            assert abs(values[0] - max(row)) < 1e-4


def run(engine, requests):
    generations = [engine.submit(r) for r in requests]
    outputs = {id(g): [] for g in generations}
    while engine.busy:
        for output in engine.step():
            outputs[id(output.generation)].append(output)
    return [outputs[id(g)] for g in generations]


@pytest.mark.slow
def test_prefill_and_decode_logprobs_match_a_plain_forward_pass(smollm2):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, PROMPTS[0])
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=8, logprobs=5))
    check(model, prompt, responses, 5)
    assert all(r.top_logprobs[0][0] == r.token for r in responses)  # greedy: the chosen token is the most likely
    assert all(r.logprob is None for r in stream_generate(model, tokenizer, prompt, max_tokens=2))


@pytest.mark.slow
def test_batched_rows_each_get_their_own_logprobs(smollm2):
    model, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    asked = [0, 3, None]
    requests = [
        Request(prompt, SamplingSettings(max_tokens=6, temperature=0.8, seed=i, logprobs=k))
        for i, (prompt, k) in enumerate(zip(prompts, asked))
    ]
    answers = run(Engine(model, tokenizer, max_batch=4), requests)
    for prompt, outputs, k in zip(prompts, answers, asked):
        if k is None:
            assert all(o.logprob is None and o.top_logprobs is None for o in outputs)
        else:
            check(model, prompt, outputs, k)


@pytest.mark.slow
def test_logprobs_are_the_models_own_under_bias_and_grammar(smollm2):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Give a number.")
    settings = SamplingSettings(max_tokens=6, constraint=Constraint.regex("[0-9]{4}"), logit_bias={33: 5.0}, logprobs=2)
    (outputs,) = run(Engine(model, tokenizer, max_batch=2), [Request(prompt, settings)])
    check(model, prompt, outputs, 2)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_speculative_rounds_report_the_models_logprobs(smollm2, drafter):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
    options = {"prompt_lookup": 3} if drafter == "prompt_lookup" else {"draft_model": model}
    engine = Engine(model, tokenizer, max_batch=1, **options)
    (outputs,) = run(engine, [Request(prompt, SamplingSettings(max_tokens=12, logprobs=4))])
    generation = outputs[0].generation
    assert generation.accepted > 0  # some tokens came from accepted drafts
    check(model, prompt, outputs, 4)


@pytest.mark.slow
def test_logit_bias_bans_and_forces_tokens(smollm2):
    model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, PROMPTS[0])
    first = next(iter(stream_generate(model, tokenizer, prompt, max_tokens=1))).token
    banned = next(iter(stream_generate(model, tokenizer, prompt, max_tokens=1, logit_bias={first: -100})))
    assert banned.token != first
    (banana,) = tokenizer.encode(" banana", add_special_tokens=False)
    forced = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=3, logit_bias=[(banana, 100)])]
    assert forced == [banana] * 3
    sampled = generate(model, tokenizer, prompt, max_tokens=3, temperature=0.8, seed=1, logit_bias={banana: 100})
    assert sampled == " banana" * 3


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"logprobs": 21}, "logprobs must be a whole number from 0 to 20"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {-1: 1.0}}, "token id"),
        ({"logit_bias": {"5": 1.0}}, "token id"),
        ({"logit_bias": {5: 101}}, "from -100 to 100"),
        ({"logit_bias": {5: math.nan}}, "from -100 to 100"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "more than one bias"),
        ({"logit_bias": 5}, "map token ids"),
    ],
)
def test_bad_logprobs_and_biases_are_refused(settings, fragment):
    with pytest.raises(InvalidSettingError, match=fragment):
        SamplingSettings(**settings)


@pytest.mark.slow
def test_a_bias_outside_the_vocabulary_is_refused_at_submit(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer)
    with pytest.raises(InvalidSettingError, match="token 49152, outside the model's vocabulary of 49152"):
        engine.submit(Request([1, 2], SamplingSettings(logit_bias={49152: 1.0})))
    assert SamplingSettings(logit_bias={7: 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
