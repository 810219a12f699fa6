"""`Distributed`: this rank's part of a split model, which the engine calls, caches and samples like a whole one."""

import mlx.core as mx
import mlx.nn as nn

from ..decode.runner import SharedSteps
from .watchdog import Watchdog, rank_timeout


class Distributed(nn.Module, SharedSteps):
    """This rank's part of a model split across a group; called, cached and sampled like the whole model.

    A rank that `passes_on` (an earlier pipeline rank) has no scores to give: it returns zeros that depend on its
    send, and `agree` hands every rank the token of the rank that sampled for real (`source`). `tensors` names
    the checkpoint tensors (in the whole model's names) this rank read.
    """

    def __init__(self, model: nn.Module, group, tensors, source: int, passes_on: bool):
        super().__init__()
        self.model, self.config, self.group = model, model.config, group
        self.rank, self.size = group.rank(), group.size()
        self.tensors = frozenset(tensors)
        self.source, self.hands_on = source, passes_on
        self.watchdog = Watchdog(rank_timeout())

    def step_guard(self):
        """What an engine step runs under: a step left waiting on another rank too long ends this process."""
        return self.watchdog.guard()

    def __call__(self, ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        out = self.model(ids, cache, last_only=last_only)
        if not self.hands_on:
            return out
        mx.async_eval(out)  # the send goes now, even where nobody reads this rank's scores (a prompt's prefill)
        return mx.depends(mx.zeros((*out.shape[:2], self.config.vocab_size)), out)

    def make_cache(self) -> list:
        return self.model.make_cache()

    def agree(self, tokens: mx.array) -> mx.array:
        """Every rank's `tokens` replaced by those of the sampling rank (the last of a pipeline, else rank 0).

        The other ranks add their own tokens times 0, not fresh zeros: their all_sum must come after the step's
        other collectives, as on the sampling rank, or the ranks would wait for each other in a different order.
        """
        mine = tokens.astype(mx.int32) * int(self.rank == self.source)
        return mx.distributed.all_sum(mine, group=self.group).astype(tokens.dtype)
