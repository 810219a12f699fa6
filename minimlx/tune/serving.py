"""Adapter folders made ready to serve side by side (`minimlx serve --adapter NAME=PATH`): each read without touching
the model (`read_adapter`), its tensors turned into the per-row form the decode engine applies (`decode.adapters`)."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..decode.adapters import Adapters, ExpertsLowRank, LowRank
from ..errors import InvalidSettingError
from .formats import Adapter, read_adapter
from .lora import base_weight


def parse_adapter_specs(specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`NAME=PATH` options -> {name: path}; a missing '=', an empty or repeated name refused."""
    named = {}
    for spec in specs:
        name, equals, path = spec.partition("=")
        if not equals or not name or not path or ":" in name:
            raise InvalidSettingError(f"--adapter takes NAME=PATH (a name without ':'), got {spec!r}")
        if name in named:
            raise InvalidSettingError(f"two adapters are named {name!r}; give each one its own")
        named[name] = path
    return named


def served_adapters(model: nn.Module, folders: dict[str, str | Path]) -> Adapters:
    """The adapters in `folders` (name -> a PEFT or mlx-lm adapter folder) attached to `model`, each request's
    rows to run with its own."""
    return Adapters(model, {name: low_ranks(model, read_adapter(model, folder)) for name, folder in folders.items()})


def low_ranks(model: nn.Module, adapter: Adapter) -> dict[str, LowRank | ExpertsLowRank]:
    """Each adapted map's `LowRank`; for DoRA, the magnitude over the norm of each row of the adapted weight (the
    base's dequantized where packed), as `DoRALinear` computes it. Each adapted experts' `ExpertsLowRank`."""
    modules, settings = dict(model.named_modules()), adapter.settings
    changes = {}
    for path in adapter.paths:
        a, b = (adapter.weights[f"{path}.{kind}"].astype(mx.float32) for kind in ("lora_a", "lora_b"))
        rescale = None
        if settings.dora:
            weight = base_weight(modules[path]).astype(mx.float32) + settings.scale * (b @ a)
            rescale = adapter.weights[f"{path}.magnitude"].astype(mx.float32) / mx.linalg.norm(weight, axis=1)
        changes[path] = LowRank(a, b, settings.scale, rescale)
    for path, parameters in adapter.experts.items():
        factors = {p: tuple(adapter.weights[f"{path}.{p}.{kind}"] for kind in ("lora_a", "lora_b")) for p in parameters}
        changes[path] = ExpertsLowRank(factors, settings.scale)
    return changes
