"""The engine's settings checked against its model before anything runs: what a cache kind cannot do is refused in
one line, asking the caches' declared capabilities."""

import mlx.nn as nn

from ..core.cache import SINKS, Can, sink_cache
from ..errors import InvalidSettingError
from .settings import check_whole


def check_max_kv_size(model: nn.Module, max_kv_size: int | None, kv_bits: int | None, max_batch: int) -> None:
    if max_kv_size is None:
        return
    check_whole("max_kv_size", max_kv_size, SINKS + 1)
    if kv_bits is not None:
        raise InvalidSettingError("max_kv_size bounds a float cache; drop kv_bits (or max_kv_size)")
    bounded = [sink_cache(c, max_kv_size) for c in model.make_cache()]
    if max_batch != 1 and not all(c.can(Can.ROWS) for c in bounded):
        raise InvalidSettingError(
            "max_kv_size keeps each sequence's first tokens, which batched sequences of other lengths cannot share; "
            "decode one at a time (--max-batch 1)"
        )
    if not all(c.can(Can.WINDOW) or c.can(Can.SHARED) for c in bounded):
        raise InvalidSettingError("max_kv_size bounds key and value caches, not latent attention's; drop it")


def recurrent(model: nn.Module) -> bool:
    """Whether some layer of `model` carries a state that can be restored but never cut back (a recurrent state)."""
    return not all(c.can(Can.CUT) for c in model.make_cache())


def check_recurrent(model: nn.Module, draft_model: nn.Module | None, prompt_lookup: bool, prompt_folder: bool) -> None:
    """Refuse, in one line, what would rewind a recurrent state: speculation cuts rejected drafts off both models'
    caches, and a prompt cache folder holds keys and values only. (The prompt cache in memory reuses a recurrent
    state only for exactly the tokens it saw.)"""
    speculative = draft_model is not None or prompt_lookup
    if speculative and (recurrent(model) or (draft_model is not None and recurrent(draft_model))):
        raise InvalidSettingError(
            "speculative decoding rewinds rejected drafts, which a recurrent layer's state cannot (it is a function "
            "of every token seen); drop the draft model / prompt lookup for this model"
        )
    if prompt_folder and recurrent(model):
        raise InvalidSettingError(
            "a prompt cache folder holds key/value caches, not a recurrent layer's state; drop the prompt cache "
            "folder for this model (the prompt cache in memory works)"
        )
