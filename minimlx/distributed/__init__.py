"""One model across several processes, over `mx.distributed`: a pipeline, or tensor parallelism.

Plugins and core never learn about ranks. The plugin builds the whole model, lazily, and loading checks
every tensor against it; then `Split.shard` cuts the model and the checkpoint's still unread tensors down
to this rank's share, so that only those are read and installed, and `Split.join` puts in the few modules
that talk to the other ranks and wraps the model (`Distributed`) so that every rank goes on with the same tokens.
`split_for(mode)` gives the strategy:

- `pipeline.PipelineSplit` (`--pipeline`): a contiguous range of blocks per rank, balanced by bytes
  (`placement.balance`); the hidden state passes rank to rank, the last rank samples.
- `tensor_parallel.TensorSplit` (`--tensor-parallel`): some of every layer's heads, hidden columns and experts
  per rank, one `all_sum` per sub-layer; rank 0 samples.

`split.Split` holds what both share: before any tensor is read, the ranks compare a digest of config, tensor
names, shapes and dtypes, and refuse to start when they differ (or when a rank's share does not fit its
machine). `communication` has the group and what a rank says; a rank that dies makes the others' next
collective fail (`peer_lost`), and one that hangs is caught by the step `watchdog`. `serve` runs a `mirrored`
engine: requests reach rank 0, which tells the other ranks at each step what joined and left the batch.
"""

from ..errors import InvalidSettingError
from .communication import LAUNCH, memory_bytes, peer_lost, rank_zero_speaks, world
from .mirrored import Mirrored, constraint_fields
from .model import Distributed
from .pipeline import HIDDEN_DTYPES, PipelineSplit, Received, Sent
from .split import Split
from .tensor_parallel import ExpertRange, Summed, TensorSplit, narrow, shares
from .watchdog import RANK_TIMEOUT, Watchdog

SPLITS: dict[str, type[Split]] = {"pipeline": PipelineSplit, "tensor": TensorSplit}
MODES = tuple(SPLITS)

__all__ = [
    "HIDDEN_DTYPES",
    "LAUNCH",
    "MODES",
    "RANK_TIMEOUT",
    "SPLITS",
    "Distributed",
    "ExpertRange",
    "Mirrored",
    "PipelineSplit",
    "Received",
    "Sent",
    "Split",
    "Summed",
    "TensorSplit",
    "Watchdog",
    "constraint_fields",
    "memory_bytes",
    "narrow",
    "peer_lost",
    "rank_zero_speaks",
    "shares",
    "split_for",
    "world",
]


def split_for(mode: str) -> Split:
    """How this rank of `world()` cuts a model in `mode` ("pipeline" or "tensor"), on a machine holding
    `memory_bytes()`."""
    if mode not in SPLITS:
        raise InvalidSettingError(f"unknown parallel mode {mode!r}; use one of {', '.join(MODES)}")
    return SPLITS[mode](world(), memory_bytes())
