"""The samplers on distributions whose answers are known by hand."""

import math

import mlx.core as mx
import numpy as np
import pytest
from reference import require

from minimlx.core.sampling import (
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    make_sampler,
)
from minimlx.decode import SamplingSettings
from minimlx.errors import InvalidSettingError

PROBS = [0.1, 0.4, 0.2, 0.3]
LOGITS = mx.array([[math.log(p) for p in PROBS]])


def kept(logits: mx.array) -> set[int]:
    return {i for i, value in enumerate(np.array(logits)[0]) if np.isfinite(value)}


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (4, {0, 1, 2, 3}), (9, {0, 1, 2, 3})])
def test_top_k(k, expected):
    assert kept(apply_top_k(LOGITS, k)) == expected


@pytest.mark.parametrize("p, expected", [(0.3, {1}), (0.6, {1, 3}), (0.75, {1, 2, 3}), (0.95, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    assert kept(apply_top_p(LOGITS, p)) == expected


@pytest.mark.parametrize("min_p, expected", [(0.3, {1, 2, 3}), (0.6, {1, 3}), (0.9, {1})])
def test_min_p_drops_tokens_under_min_p_times_the_top(min_p, expected):
    assert kept(apply_min_p(LOGITS, min_p)) == expected


def test_top_p_over_a_large_vocabulary_matches_float64():
    logits = np.random.default_rng(0).normal(size=(1, 49152)).astype(np.float32) * 3
    probs = np.exp(logits[0].astype(np.float64) - logits.max())
    mass = np.cumsum(np.sort(probs / probs.sum())[::-1])
    for p in (0.5, 0.9, 0.95):  # boundaries at least 4e-6 away from the next token: beyond float32 rounding
        assert len(kept(apply_top_p(mx.array(logits), p))) == np.searchsorted(mass, p) + 1


def test_filters_leave_kept_logits_unchanged():
    filtered = np.array(apply_top_p(LOGITS, 0.6))[0]
    np.testing.assert_allclose(filtered[[1, 3]], np.log([0.4, 0.3]), rtol=1e-6)


def test_repetition_penalty():
    logits = mx.array([[2.0, -1.0, 0.5, 3.0]])
    penalized = apply_repetition_penalty(logits, mx.array([0, 1, 0]), 2.0)
    np.testing.assert_allclose(np.array(penalized), [[1.0, -2.0, 0.5, 3.0]])
    np.testing.assert_allclose(np.array(logits), [[2.0, -1.0, 0.5, 3.0]])  # pure: the input is untouched


def test_filters_match_transformers():
    torch = require("torch")
    processors = require("transformers")
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 500)).astype(np.float32) * 2
    seen = rng.integers(0, 500, size=40)
    cases = [
        (apply_top_k(mx.array(logits), 17), processors.TopKLogitsWarper(17)),
        (apply_min_p(mx.array(logits), 0.05), processors.MinPLogitsWarper(0.05)),
        (
            apply_repetition_penalty(mx.array(logits), mx.array(seen), 1.3),
            processors.RepetitionPenaltyLogitsProcessor(1.3),
        ),
    ]
    for ours, theirs in cases:
        expected = theirs(torch.tensor(seen[None]), torch.tensor(logits)).numpy()
        np.testing.assert_allclose(np.array(ours), expected, rtol=1e-6)


def test_temperature_zero_is_greedy():
    assert make_sampler(0.0)(LOGITS, None).item() == 1


def test_sampling_follows_the_filtered_distribution():
    rows = mx.broadcast_to(LOGITS, (8000, 4))
    draws = np.array(make_sampler(1.0, top_p=0.6)(rows, mx.random.key(0)))
    counts = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(counts, [0, 0.4 / 0.7, 0, 0.3 / 0.7], atol=0.02)


def test_a_seed_reproduces_a_sample():
    sampler = make_sampler(1.5, top_k=3)
    rows = mx.broadcast_to(LOGITS, (64, 4))
    first, again = sampler(rows, mx.random.key(7)), sampler(rows, mx.random.key(7))
    other = sampler(rows, mx.random.key(8))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 2}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -3}, "top_k must be >= 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ],
)
def test_nonsense_settings_are_refused(settings, message):
    with pytest.raises(InvalidSettingError, match=message):
        SamplingSettings(**settings)
