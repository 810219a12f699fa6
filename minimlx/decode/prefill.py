"""Feeding known tokens into a cache: the chunked prefill, and the shared start that says what a cache can reuse.

The engine's prompts, speculation's draft model and the conversation all go through these two.
"""

import mlx.core as mx
import mlx.nn as nn


def prefill(model: nn.Module, ids: list[int], cache: list, step: int) -> mx.array | None:
    """Feed `ids` into `cache`, `step` tokens per forward pass: the logits (1, 1, vocab) of the last one (lazy),
    None without ids. Each pass but the last is evaluated before the next is built, so that memory holds the
    activations of one chunk only; the caller evaluates the last with what it reads from it."""
    tokens = mx.array(ids, dtype=mx.int32)
    logits = None
    for start in range(0, tokens.size, step):
        if logits is not None:
            mx.eval([c.state for c in cache])
        logits = model(tokens[None, start : start + step], cache, last_only=True)
    return logits


def shared_start(held: list[int], ids: list[int]) -> int:
    """How many first tokens of `ids` a cache of `held` already holds, leaving the last of `ids` to feed (its logits
    are what comes next)."""
    limit = min(len(held), len(ids) - 1)
    shared = 0
    while shared < limit and held[shared] == ids[shared]:
        shared += 1
    return shared
