"""Checks of what callers hand the model and generation: token ids and the settings around sampling.

Each raises InvalidSettingError naming the value and what is allowed, before any work is done.
(The sampling settings themselves are checked by `core.sampling.check_settings`.)
"""

import numbers
from collections.abc import Sequence

from .errors import InvalidSettingError

SEEDS = 2**64  # mx.random.key takes seeds in [0, 2**64)


def whole(value) -> bool:
    """An integer (Python's or NumPy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def vocab_size(model) -> int | None:
    """The size of a model's token embedding, as its plugin config states it (None when it does not)."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


def check_ids(ids, vocab_size: int | None) -> list[int]:
    """`ids` (a sequence or 1-d array of token ids) as a list of ints, each in [0, vocab_size)."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        kind = "bytes; decode them to text first" if isinstance(ids, (bytes, bytearray)) else type(ids).__name__
        raise InvalidSettingError(f"the prompt must be text or a sequence of token ids, not {kind}")
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if not values:
        raise InvalidSettingError("the prompt is empty (no token ids); give at least one token")
    for token in values:
        if not whole(token):
            raise InvalidSettingError(f"token ids must be whole numbers, got {token!r}")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise InvalidSettingError(f"token id {token} is outside the model's vocabulary (0 to {vocab_size - 1})")
    return [int(token) for token in values]


def check_prompt(prompt, vocab_size: int | None) -> str | list[int]:
    """A prompt as generation takes it: text as it is, token ids checked by `check_ids`."""
    return prompt if isinstance(prompt, str) else check_ids(prompt, vocab_size)


def check_whole(name: str, value, low: int, high: int | None = None) -> None:
    """Refuse `value` unless it is a whole number in [low, high]."""
    if not whole(value) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise InvalidSettingError(f"{name} must be a whole number {span}, got {value!r}")


def check_generation(max_tokens, seed=None, stop=None) -> list[str]:
    """Refuse a token budget, seed or stop strings that mean nothing; the stop strings as a list (one bare
    string is one stop string)."""
    check_whole("max_tokens", max_tokens, 1)
    if seed is not None:
        check_whole("seed", seed, 0, SEEDS - 1)
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidSettingError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return list(stops)
