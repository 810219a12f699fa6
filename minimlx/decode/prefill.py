"""Feeding known tokens into a cache: the chunked prefill, and the shared start that says what a cache can reuse.

The engine's prompts, speculation's draft model and the conversation all go through these two.
"""

import mlx.core as mx
import mlx.nn as nn

from ..core.steps import prompt_steps


def prefill(model: nn.Module, ids: list[int], cache: list, step: int) -> mx.array | None:
    """Feed `ids` into `cache`, `step` tokens per forward pass: the logits (1, 1, vocab) of the last one (lazy),
    None without ids. Each pass but the last is evaluated before the next is built, so that memory holds the
    activations of one chunk only; the caller evaluates the last with what it reads from it.

    The cache is marked (`Cache.mark`) where the feed starts and after every pass: a recurrent state can later go
    back to those counts (a prompt sharing only the start of this one restores the latest at or before it)."""
    tokens = mx.array(ids, dtype=mx.int32)
    logits = None
    marked(cache)
    for start in range(0, tokens.size, step):
        if logits is not None:
            mx.eval([c.state for c in cache])
        with prompt_steps():
            logits = model(tokens[None, start : start + step], cache, last_only=True)
        marked(cache)
    return logits


def marked(cache: list) -> list:
    """`cache`, each layer marked at the tokens it holds."""
    for c in cache:
        c.mark()
    return cache


def prefill_prompt(model: nn.Module, ids: list[int], cache: list, step: int) -> mx.array:
    """Feed a prompt's `ids` (at least one) into `cache`, its last token in a pass of its own: the logits (1, 1, vocab)
    of that token (lazy), from which the first answer token is drawn.

    A prompt whose start the prompt cache holds is fed from there, its last token at least, often only that; so
    that the logits do not depend on how much was cached, the last token is always computed alone (the kernel's
    products of one row sum in another order than those of a chunk's many, and a decode step's integer products
    turn such last-bit differences into different roundings of their 8-bit inputs, hence another greedy answer
    from the second token on). It costs one pass of one token per prompt."""
    prefill(model, ids[:-1], cache, step)
    if len(ids) > 1:
        mx.eval([c.state for c in cache])
    with prompt_steps():
        logits = model(mx.array([ids[-1:]], dtype=mx.int32), cache, last_only=True)
    marked(cache)  # the whole prompt: where a conversation's next turn continues when the answer is written anew
    return logits


def shared_start(held: list[int], ids: list[int]) -> int:
    """How many first tokens of `ids` a cache of `held` already holds, leaving the last of `ids` to feed (its logits
    are what comes next)."""
    limit = min(len(held), len(ids) - 1)
    shared = 0
    while shared < limit and held[shared] == ids[shared]:
        shared += 1
    return shared


def reusable(cache: list, count: int) -> int:
    """The most first tokens, `count` at most, that every layer of `cache` can go back to (a recurrent state only to
    a count it marked, a window not before what it dropped): 0 when none."""
    while (kept := min(c.latest_kept(count) for c in cache)) != count:
        count = kept
    return count
