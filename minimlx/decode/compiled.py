"""A compiled forward pass for one sequence: traced once, replayed for every decode step.

Eager decoding builds and schedules thousands of primitive ops per token, each with its own overhead
(docs/performance.md). `mx.compile` records the step once and replays the recorded graph (with its
elementwise ops fused), but only while nothing the step reads changes between calls except the arrays passed
in: so the step runs over `FixedKVCache`s, whose position is an array and whose capacity is a shape. A new
capacity traces the step again (once per 256 tokens); prompts run eagerly.
"""

import mlx.core as mx
import mlx.nn as nn

from ..core.cache import KVCache, pad
from ..core.steps import decoding
from ..core.transformer import Transformer


class FixedKVCache:
    """Keys and values (1, kv_heads, capacity, head_dim) of one sequence, written at an array position.

    What a compiled decode step needs: the forward pass reads only arrays (`start`, the buffers) and shapes
    from it, so `mx.compile` traces a step once per capacity and replays it for every token. A one-token step's
    attention reads the whole capacity, the mask hiding the columns past the last token (so trimming only moves
    `offset` and `start` back); longer calls (prompts, speculative checks) run eagerly over the filled columns
    alone. The capacity grows by `step` tokens when an update would not fit (the compiled step then retraces
    once).
    """

    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.start = mx.array([0])  # `offset` as an array of one: where the next token goes

    def capacity_for(self, tokens: int) -> int:
        """The capacity once `tokens` more are written: the current one if they fit, else the next multiple
        of `step`."""
        capacity = self.keys.shape[2] if self.keys is not None else 0
        needed = self.offset + tokens
        return capacity if needed <= capacity else (needed + self.step - 1) // self.step * self.step

    def reserve(self, tokens: int) -> None:
        """Grow the buffers (once they exist) so that `tokens` more fit."""
        capacity = self.capacity_for(tokens)
        if self.keys is not None and capacity > self.keys.shape[2]:
            self.keys, self.values = (pad(a, 0, capacity - a.shape[2]) for a in (self.keys, self.values))

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        tokens = keys.shape[2]
        if self.keys is None:
            shape = (*keys.shape[:2], self.capacity_for(tokens), keys.shape[3])
            self.keys, self.values = mx.zeros(shape, keys.dtype), mx.zeros((*shape[:3], values.shape[3]), values.dtype)
        self.reserve(tokens)
        self.keys = mx.slice_update(self.keys, keys, self.start, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.start, axes=(2,))
        self.start = self.start + tokens
        self.offset += tokens
        if tokens > 1:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    @property
    def position(self) -> mx.array:
        return self.start

    def mask(self, tokens: int) -> str | mx.array:
        """One token (the compiled step): (1, 1, 1, capacity), the columns up to its position `start` (computed
        once per pass: the loop's `Positions` hands it to every layer). Several: "causal" over the filled columns
        `update` returns (the fast causal attention a prompt needs)."""
        if tokens > 1:
            return "causal"
        return (mx.arange(self.capacity_for(tokens)) <= self.start)[None, None, None]

    def keeps(self, count: int) -> bool:
        return count <= self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self.start = mx.array([self.offset])
        return n

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes if self.keys is not None else 0

    @property
    def state(self) -> list[mx.array]:
        return [self.keys, self.values, self.start] if self.keys is not None else [self.start]

    def select(self, rows: list[int]) -> "FixedKVCache":
        if rows != [0]:
            raise ValueError(f"a FixedKVCache holds one sequence; rows {rows} were asked for")
        return self

    @classmethod
    def merge(cls, caches: list["FixedKVCache"]) -> "FixedKVCache":
        if len(caches) != 1:
            raise ValueError(f"a FixedKVCache holds one sequence; {len(caches)} were to be merged")
        return caches[0]


class CompiledDecoder:
    """Stands in for `model` where the engine decodes one sequence at a time.

    `make_cache()` gives `FixedKVCache`s; a decode step over them (one token, under `core.steps.decode_steps`) runs
    the compiled step, traced as a decode step; everything else (prompts, a prompt's last token alone, speculative
    verification, other caches) runs the model as it is.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = getattr(model, "config", None)
        self.cache: list[FixedKVCache] = []
        self.forward = mx.compile(self.traced, inputs=model.state)

    def make_cache(self) -> list[FixedKVCache]:
        return [FixedKVCache() for _ in self.model.layers]

    def traced(self, ids: mx.array, start: mx.array, buffers: list[list[mx.array]]):
        """One step, every layer at the position `start`: one array for all of them."""
        for c, (keys, values) in zip(self.cache, buffers):
            c.keys, c.values, c.start = keys, values, start
        logits = self.model(ids, self.cache)
        return logits, self.cache[0].start, [[c.keys, c.values] for c in self.cache]

    def __call__(self, ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        compiled = (
            decoding()
            and cache is not None
            and ids.shape[1] == 1
            and all(isinstance(c, FixedKVCache) and c.keys is not None for c in cache)
        )
        if not compiled:
            return self.model(ids, cache, last_only=last_only)
        offset = cache[0].offset
        for c in cache:
            c.reserve(1)
        self.cache = cache
        logits, start, buffers = self.forward(ids, cache[0].start, [[c.keys, c.values] for c in cache])
        for c, (keys, values) in zip(cache, buffers):
            c.keys, c.values, c.start, c.offset = keys, values, start, offset + 1
        return logits


def compiled_decoder(model: nn.Module) -> CompiledDecoder | None:
    """The compiled stand-in for `model`, or None when one of its layers needs another cache than a plain KV
    cache (latent attention, sliding windows) or it is not the one loop itself (a model split over ranks, whose
    steps talk to the other ranks): those decode eagerly.

    One per model, kept on it, so that every generation replays the same traces.
    """
    if not isinstance(model, Transformer) or not all(type(c) is KVCache for c in model.make_cache()):
        return None
    if getattr(model, "compiled_decoder", None) is None:
        model.compiled_decoder = CompiledDecoder(model)
    return model.compiled_decoder


def decoder(model: nn.Module, compiled: bool) -> nn.Module:
    """What decodes one sequence at a time of `model`: its compiled step where it has one and `compiled`, else
    the model itself."""
    return (compiled and compiled_decoder(model)) or model
