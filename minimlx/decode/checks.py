"""The engine's settings checked against its model before anything runs: what a cache kind cannot do is refused in
one line, asking the caches' declared capabilities. (A recurrent state, which cannot be cut, is not refused anything:
speculation restores it from a snapshot, and the prompt cache from the marks its prefill left.)"""

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
