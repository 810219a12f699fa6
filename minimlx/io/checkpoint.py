"""Checkpoint folders: safetensors shards in, checked weights into a model.

io knows files, not architectures: the caller (`minimlx.loading`) asks the registry for the plugin
that names and builds the model, and hands its tensors back here to be checked and installed.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import CheckpointError
from .config import read_json

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def read_safetensors(folder: Path) -> dict[str, mx.array]:
    """All tensors of `model.safetensors`, or of the shards `model.safetensors.index.json` lists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor names to file names; re-download it")
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors weights; convert the checkpoint to safetensors")
    weights = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"shard {name} listed in the index is missing from {folder}; re-download it")
        try:
            weights.update(mx.load(str(path)))
        except Exception as e:
            raise CheckpointError(
                f"cannot read {path}: {e}; the file is corrupt or truncated, re-download it"
            ) from None
    return weights


MISMATCH = "the weights and the config disagree: re-download the checkpoint or fix its config"


def check_weights(model: nn.Module, weights: dict[str, mx.array], origin: dict[int, str]) -> None:
    """Every parameter present with the config's shape, nothing left over; errors name the tensor."""
    expected = dict(tree_flatten(model.parameters()))

    def called(name):
        source = origin.get(id(weights.get(name)))
        return f"{name!r}" + (f" (checkpoint tensor {source!r})" if source and source != name else "")

    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}{more}; {MISMATCH}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {called(unexpected[0])}{more}; {MISMATCH}")
    for name, param in expected.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {called(name)} has shape {tuple(weights[name].shape)} but the config implies "
                f"{tuple(param.shape)}; {MISMATCH}"
            )


def install_weights(
    model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype | None, as_stored: set[str] = frozenset()
) -> None:
    """Cast floating tensors to `dtype` (when given; not those `as_stored` names) and put them in the model, one
    tensor at a time.

    Each tensor is computed (read, dequantized, cast) on its own and the dict's reference to its source is
    dropped, so loading holds the finished model plus one tensor's worth of inputs, never two copies.
    """
    done = []
    for name in list(weights):
        w = weights.pop(name)
        if dtype is not None and mx.issubdtype(w.dtype, mx.floating) and name not in as_stored:
            w = w.astype(dtype)
        mx.eval(w)
        done.append((name, w))
    model.update(tree_unflatten(done))
