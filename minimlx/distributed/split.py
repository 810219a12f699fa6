"""`Split`: how this rank cuts a model, the interface the pipeline and tensor parallel strategies share.

`shard` runs before the model's tensors are installed: it checks that every rank holds the same model, lets the
strategy `cut` the model and its unread tensors to this rank's share, and checks that the share fits. `join`
runs after: the strategy `link`s in the modules that talk to the other ranks, and the model is wrapped.
"""

import hashlib
from abc import ABC, abstractmethod

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import CheckpointError, InvalidSettingError
from .model import Distributed


class Split(ABC):
    """One way of cutting a model over `group`, on a machine that holds `room` bytes. `tensors` names the
    checkpoint tensors (in the whole model's names) this rank keeps, once `shard` has run."""

    mode: str  # the --parallel name of the strategy ("pipeline", "tensor")
    flag: str  # the command line's option for it

    def __init__(self, group: mx.distributed.Group, room: int):
        self.group, self.room = group, room
        self.rank, self.size = group.rank(), group.size()
        self.tensors: list[str] = []

    @abstractmethod
    def cut(self, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Cut `model` (built, not loaded) to this rank's part and return the tensors that part takes, under its
        names; sets `tensors`."""

    @abstractmethod
    def link(self, model: nn.Module) -> None:
        """Put the modules that talk to the other ranks into the loaded part."""

    @abstractmethod
    def sampling_rank(self) -> int:
        """The rank whose sampled tokens every rank goes on with."""

    @abstractmethod
    def passes_on(self) -> bool:
        """Whether this rank hands its hidden state on rather than scoring tokens itself."""

    def shard(
        self, model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype | None = None
    ) -> tuple[nn.Module, dict[str, mx.array]]:
        """This rank's part of `model` (built, not loaded) and the (unread) tensors it needs, under its names;
        `dtype` is the one floating tensors will be cast to when installed."""
        if not model.blocks_apart:
            raise InvalidSettingError(
                f"{self.flag} cannot split this model yet: its layers read other layers' keys and values "
                "or inputs of their own, or hold experts beside the FFN (Gemma 4); run it on one machine"
            )
        self.check_same(model, weights)
        weights = self.cut(model, weights)
        self.check_room(weights, dtype)
        return model, weights

    def join(self, model: nn.Module) -> Distributed:
        """The loaded part, with the modules that talk to the other ranks put in."""
        self.link(model)
        return Distributed(model, self.group, self.tensors, self.sampling_rank(), self.passes_on())

    def check_same(self, model: nn.Module, weights: dict[str, mx.array]) -> None:
        """Refuse, before a tensor is read, ranks that hold different models or were asked to split differently."""
        signature = (
            self.mode,
            repr(model.config),
            sorted((n, tuple(w.shape), str(w.dtype)) for n, w in weights.items()),
        )
        digest = np.frombuffer(hashlib.sha256(repr(signature).encode()).digest(), dtype=np.int32)
        rows = mx.distributed.all_gather(mx.array(digest)[None], group=self.group).tolist()
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        if differ:
            raise CheckpointError(
                f"rank {differ[0]} loaded a different model than rank 0 (config, tensor names, shapes or dtypes, "
                "or --pipeline/--tensor-parallel differ); give every rank the same model files and flags"
            )

    def check_room(self, weights: dict[str, mx.array], dtype: mx.Dtype | None) -> None:
        """Refuse, before a tensor is read, a share some rank's machine cannot hold: every rank learns of it, so
        that rank 0 can say which."""
        floats = dtype.size if dtype is not None else None
        needed = sum(
            w.size * (floats or w.dtype.size) if mx.issubdtype(w.dtype, mx.floating) else w.nbytes
            for w in weights.values()
        )
        megabytes = mx.array([[needed / 1e6, self.room / 1e6]])
        for rank, (need, room) in enumerate(mx.distributed.all_gather(megabytes, group=self.group).tolist()):
            if need > room:
                raise InvalidSettingError(
                    f"rank {rank}'s share of the model needs {need / 1e3:.2f} GB of weights but its machine has "
                    f"{room / 1e3:.2f} GB; split it over more ranks (minimlx anatomy MODEL --ranks N --memory GB "
                    "shows the plan) or load it quantized"
                )
