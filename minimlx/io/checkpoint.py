"""Loading a model: config -> plugin -> lazy model -> checked, renamed, cast weights."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..archs import get_arch
from ..errors import CheckpointError, InvalidSettingError, ModelNotFoundError
from .config import read_config

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidSettingError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_safetensors(folder: Path) -> dict[str, mx.array]:
    """All tensors of `model.safetensors`, or of the shards `model.safetensors.index.json` lists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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
            raise CheckpointError(f"cannot read {path}: {e}; the file is corrupt or truncated, re-download it") from None
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
        raise CheckpointError(
            f"checkpoint has unexpected tensor {called(unexpected[0])}{more}; {MISMATCH}"
        )
    for name, param in expected.items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {called(name)} has shape {tuple(weights[name].shape)} but the config implies "
                f"{tuple(param.shape)}; {MISMATCH}"
            )


def install_weights(model: nn.Module, weights: dict[str, mx.array], dtype: mx.Dtype | None) -> None:
    """Cast floating tensors to `dtype` (when given), put them in the model and evaluate."""
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())


def build_model(config: dict) -> nn.Module:
    """The model a config describes, with lazy (unallocated) parameters; `model.config` is the plugin config."""
    arch = get_arch(config.get("model_type")).from_config(config)
    model = arch.build()
    model.config = arch
    return model


def load_model(path: str | Path, dtype: str | None = None) -> nn.Module:
    """Load a Hugging Face checkpoint folder (config.json + safetensors) as a minimlx model."""
    folder = Path(path)
    if not folder.exists():
        raise ModelNotFoundError(f"no such model folder: {folder}")
    model = build_model(read_config(folder))
    arch = model.config
    raw = read_safetensors(folder)
    origin = {id(v): k for k, v in raw.items()}
    weights = arch.convert_weights(raw)
    check_weights(model, weights, origin)
    install_weights(model, weights, parse_dtype(dtype))
    return model
