"""Pipeline parallelism (`--pipeline`): rank r holds one contiguous range of blocks, balanced by bytes
(`placement.balance`); the first rank also holds the embedding, the last the final norm and the head.

The hidden state passes rank to rank with `send`/`recv` through the slots of the one loop: on a later rank the
embedding's slot receives it, on an earlier one the final norm's slot sends it on and the head's slot scores
nothing. The last rank samples.
"""

import mlx.core as mx
import mlx.nn as nn

from .placement import BEFORE, balance, section_bytes
from .split import Split

HIDDEN_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class Received(nn.Module):
    """The embedding's slot on a later pipeline rank: the hidden state the previous rank sent, instead of
    embedding the ids. The last rank of a tied model keeps the embedding as `table`, for its head."""

    def __init__(self, dims: int, dtype: mx.Dtype, source: int, group, table: nn.Module | None = None):
        super().__init__()
        self.dims, self.dtype, self.source, self.group = dims, dtype, source, group
        if table is not None:
            self.table = table

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.distributed.recv((*ids.shape, self.dims), self.dtype, self.source, group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.table.as_linear(x)


class Sent(nn.Module):
    """The final norm's slot on an earlier pipeline rank: the hidden state goes on, as it is, to the next rank."""

    def __init__(self, target: int, group):
        super().__init__()
        self.target, self.group = target, group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.send(x, self.target, group=self.group)


class PipelineSplit(Split):
    """This rank's range of blocks, linked to the previous and the next rank's."""

    mode = "pipeline"
    flag = "--pipeline"

    def first(self) -> bool:
        return self.rank == 0

    def last(self) -> bool:
        return self.rank == self.size - 1

    def sampling_rank(self) -> int:
        return self.size - 1

    def passes_on(self) -> bool:
        return not self.last()

    def cut(self, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """This rank's range of blocks (renumbered from 0), and the embedding or head if it holds them."""
        before, blocks, after = section_bytes(weights.items(), len(model.layers), model.tied_head)
        self.span = balance(blocks, self.size, before, after)[self.rank]

        def mine(name: str) -> bool:
            top, _, rest = name.partition(".")
            if top == "layers":
                return int(rest.partition(".")[0]) in self.span
            if top in BEFORE:
                return self.first() or (self.last() and model.tied_head and top == "embed")
            return self.last()

        self.tensors = sorted(name for name in weights if mine(name))
        self.dims = model.norm.weight.shape[-1]
        kept = {}
        for name in self.tensors:
            top, _, rest = name.partition(".")
            if top == "layers":
                layer, _, rest = rest.partition(".")
                kept[f"layers.{int(layer) - self.span.start}.{rest}"] = weights.pop(name)
            else:
                kept[name] = weights.pop(name)
        weights.clear()  # the other ranks' tensors: never read
        model.layers = model.layers[self.span.start : self.span.stop]
        return kept

    def link(self, model: nn.Module) -> None:
        """Receive in the embedding's slot (all but the first rank), send in the final norm's (all but the last),
        after agreeing on the hidden state's dtype (the first rank's embedding output)."""
        first, last = self.first(), self.last()
        code = HIDDEN_DTYPES.index(model.embed(mx.zeros((1, 1), mx.int32)).dtype) if first else 0
        dtype = HIDDEN_DTYPES[mx.distributed.all_sum(mx.array(code), group=self.group).item()]
        if not first:
            table = model.embed if last and model.tied_head else None
            model.embed = Received(self.dims, dtype, self.rank - 1, self.group, table)
            model.pop("positions", None)
        if not last:
            model.norm = Sent(self.rank + 1, self.group)
            model.head = nn.Identity()
