"""A compiled forward pass for one sequence: traced once, replayed for every decode step.

Eager decoding builds and schedules thousands of primitive ops per token, each with its own overhead
(docs/performance.md). `mx.compile` records the step once and replays the recorded graph (with its
elementwise ops fused), but only while nothing the step reads changes between calls except the arrays passed
in: so the step runs over `FixedKVCache`s, whose position is an array and whose capacity is a shape. A new
capacity traces the step again (once per 256 tokens); prompts run eagerly.
"""

import gc

import mlx.core as mx
import mlx.nn as nn

from ..core.cache import Cache, Can, FixedKVCache, KVCache
from ..core.steps import decoding
from ..core.transformer import Transformer


class CompiledDecoder:
    """Stands in for `model` in the engine's decode steps.

    `make_cache()` gives `FixedKVCache`s; a decode step over them (one token, under `core.steps.decode_steps`) runs
    the compiled step, traced as a decode step. So does a decode step of a batch of one over growing caches (a
    batching engine with one sequence left, or one at all): over `FixedKVCache` views of their buffers, which take
    the step's writes back. Everything else (prompts, a prompt's last token alone, speculative verification, batches
    of several, other caches) runs the model as it is.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = getattr(model, "config", None)
        self.cache: list[FixedKVCache] = []
        self.forward = mx.compile(self.traced, inputs=model.state)

    def forget(self) -> None:
        """Drop the traces: MLX keeps them in a process-wide cache while their compiled function lives, and traces made
        on a stream of a thread's own (the server's engine thread) end the process with std::terminate when they are
        still there as it exits. The old function may sit in a reference cycle (a failed request's traceback), so
        it is collected here."""
        self.forward = mx.compile(self.traced, inputs=self.model.state)
        gc.collect()

    def make_cache(self) -> list[FixedKVCache]:
        return [FixedKVCache() for _ in self.model.layers]

    def traced(self, ids: mx.array, start: mx.array, shift: mx.array, buffers: list[list[mx.array]]):
        """One step, every layer at the position `start` (its rotary position shifted by `shift`): one array for all
        of them."""
        for c, held in zip(self.cache, buffers):
            c.hold(held)
            c.start, c.shift = start, shift
        logits = self.model(ids, self.cache)
        return logits, self.cache[0].start, [c.buffers for c in self.cache]

    def __call__(self, ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        if decoding() and cache is not None and ids.shape[1] == 1:
            if all(c.can(Can.FIXED) and c.buffers is not None for c in cache):
                return self.step(ids, cache)
            if ids.shape[0] == 1 and all(viewable(c) for c in cache):
                return self.step_over(ids, cache)
        return self.model(ids, cache, last_only=last_only)

    def step_over(self, ids: mx.array, cache: list[KVCache]) -> mx.array:
        """The compiled step of one sequence over growing caches: over views of their buffers, written back."""
        start, shift = mx.array([cache[0].offset]), mx.array(cache[0].row_shifts())
        views = [FixedKVCache.over(*c.arrays, c.offset, start, shift) for c in cache]
        for c in cache:  # the views alone hold the buffers, so that the step may write them in place
            c.arrays = None
        try:
            logits = self.step(ids, views)
        finally:
            for c, view in zip(cache, views):
                c.arrays, c.offset = view.buffers, view.offset
        return logits

    def step(self, ids: mx.array, cache: list[FixedKVCache]) -> mx.array:
        offset = cache[0].offset
        for c in cache:
            c.reserve(1)
        self.cache = cache
        shift = cache[0].shift
        logits, start, buffers = self.forward(ids, cache[0].start, shift, [c.buffers for c in cache])
        for c, held in zip(cache, buffers):
            c.hold(held)
            c.start, c.shift, c.offset = start, shift, offset + 1
        return logits


def float_buffers(cache: Cache) -> bool:
    """Whether `cache` holds float keys and values in `buffers` that an op writes a token into: what the compiled
    step's `FixedKVCache` holds, or can stand over."""
    return cache.can(Can.BUFFERS) and not cache.can(Can.QUANTIZED)


def viewable(cache: Cache) -> bool:
    """Whether a `FixedKVCache` view can stand over `cache`'s buffers: a growing one of float keys and values, holding
    tokens of one unpadded row."""
    growing = float_buffers(cache) and not cache.can(Can.FIXED)
    return growing and cache.buffers is not None and not any(cache.row_padding())


def compiled_decoder(model: nn.Module) -> CompiledDecoder | None:
    """The compiled stand-in for `model`, or None when one of its layers needs another cache than a plain KV
    cache (latent attention, sliding windows) or it is not the one loop itself (a model split over ranks, whose
    steps talk to the other ranks): those decode eagerly.

    One per model, kept on it, so that every generation replays the same traces.
    """
    if not isinstance(model, Transformer) or not all(float_buffers(c) for c in model.make_cache()):
        return None
    if getattr(model, "compiled_decoder", None) is None:
        model.compiled_decoder = CompiledDecoder(model)
    return model.compiled_decoder


def decoder(model: nn.Module, compiled: bool) -> nn.Module:
    """What decodes one sequence at a time of `model`: its compiled step where it has one and `compiled`, else
    the model itself."""
    return (compiled and compiled_decoder(model)) or model
