"""Picking the next token from the logits: pure functions over the last axis.

The filters mask excluded tokens with -inf and leave the others' logits untouched, so they
compose in Hugging Face's order: temperature, top-k, top-p, min-p. A random key makes a draw
reproducible: the same key and logits give the same token.
"""

import math
from collections.abc import Callable

import mlx.core as mx

Sampler = Callable[[mx.array, mx.array | None], mx.array]


def apply_top_k(logits: mx.array, k: int) -> mx.array:
    """Keep the `k` most likely tokens (and any tied with the k-th)."""
    if k >= logits.shape[-1]:
        return logits
    kth = mx.topk(logits, k, axis=-1).min(axis=-1, keepdims=True)
    return mx.where(logits < kth, -mx.inf, logits)


def apply_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose probabilities add up to at least `p`.

    A token stays when the tokens more likely than it hold less than `p` of the mass, that is when
    it and the less likely ones hold more than `1 - p` (ties with the least likely kept token stay
    too). Summing from the small end, as transformers does, keeps float32 rounding small where the
    threshold falls; sorting values is cheaper than sorting indices.
    """
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    ascending = mx.sort(probs, axis=-1)
    up_to = mx.cumsum(ascending, axis=-1)
    threshold = mx.where(up_to > 1 - p, ascending, mx.inf).min(axis=-1, keepdims=True)
    return mx.where(probs < threshold, -mx.inf, logits)


def apply_min_p(logits: mx.array, min_p: float) -> mx.array:
    """Drop the tokens less likely than `min_p` times the most likely one."""
    threshold = logits.max(axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits < threshold, -mx.inf, logits)


def apply_repetition_penalty(logits: mx.array, tokens: mx.array, penalty: float) -> mx.array:
    """Make the tokens already seen less likely (CTRL's rule, as in transformers).

    Positive logits are divided by `penalty`, negative ones multiplied. logits: (batch, vocab),
    tokens: (seen,) ids shared by the batch.
    """
    tokens = mx.broadcast_to(tokens, (logits.shape[0], tokens.size))
    seen = mx.take_along_axis(logits, tokens, axis=-1)
    return mx.put_along_axis(logits, tokens, mx.where(seen < 0, seen * penalty, seen / penalty), axis=-1)


def greedy(logits: mx.array, key: mx.array | None = None) -> mx.array:
    """The most likely token of each row: the sampler at temperature 0 (rows are independent, so a batch of
    greedy rows takes one argmax)."""
    return mx.argmax(logits, axis=-1)


def filtered_logits(
    logits: mx.array, temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> mx.array:
    """The logits a token is drawn from at `temperature` (> 0): scaled, then filtered by top-k, top-p and min-p (the
    one filter chain of the sampler and of speculative verification)."""
    logits = logits.astype(mx.float32) / temperature
    if top_k > 0:
        logits = apply_top_k(logits, top_k)
    if top_p < 1.0:
        logits = apply_top_p(logits, top_p)
    if min_p > 0.0:
        logits = apply_min_p(logits, min_p)
    return logits


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """`sampler(logits, key) -> token ids`: argmax at temperature 0, else a draw from the filtered distribution.
    (The settings are checked by `minimlx.decode.SamplingSettings`.)"""
    if temperature == 0:
        return greedy

    def sample(logits: mx.array, key: mx.array | None = None) -> mx.array:
        return mx.random.categorical(filtered_logits(logits, temperature, top_p, top_k, min_p), axis=-1, key=key)

    return sample


def token_logprobs(logits: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """(log-probability of each chosen token (rows,), the ids (rows, k) of the k most likely tokens, most likely
    first, and their log-probabilities (rows, k)) under the distribution of `logits` (rows, vocab)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.uint32), axis=-1)[:, 0]
    if k == 0:
        return chosen, mx.zeros((logits.shape[0], 0), mx.uint32), mx.zeros((logits.shape[0], 0))
    ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
