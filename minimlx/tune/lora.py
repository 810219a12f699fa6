"""Low-rank adapters as forms of a linear map, the way PEFT defines them.

`LoRALinear` wraps any linear map minimlx builds (MLX's `nn.Linear`, `nn.QuantizedLinear` for packed MLX folders and
GGUF files, and their CPU forms) and adds a trainable low-rank product to it: y = base(x) + scale * dropout(x) A^T B^T,
with A (`lora_a`, rank x in) and B (`lora_b`, out x rank) laid out as PEFT stores them and scale = alpha / rank.
The base stays frozen and, where it is packed, packed: gradients reach earlier layers through its quantized product.

`DoRALinear` is PEFT's weight-decomposed form: the adapted weight W + scale * B A is split into its per-row direction
and a learned magnitude m, y = m / ||W + scale B A|| * (x W^T + scale x A^T B^T) + bias, with the norm detached from
the gradient (as PEFT and the DoRA paper do).

Targets are named as Hugging Face names the projections (`q_proj`, `down_proj`): each linear map's module path is
turned into its checkpoint name by the family's `NameMap`, and matched as PEFT matches `target_modules`.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..core import Router
from ..cpu.linear import NativeBlockLinear
from ..cpu.linear import dequantized as block_weight
from ..errors import InvalidSettingError

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterSettings:
    """What an adapter is: its rank, alpha (scale = alpha / rank), dropout on the adapter's input, the projections it
    adapts (Hugging Face's names, or "all-linear": every linear map of the blocks but the routers, as PEFT's
    `all-linear` on dense models; on mixtures of experts PEFT's also adapts the stacked experts and the routers,
    which minimlx does not), DoRA or plain LoRA, and the layers it covers (None: all; N: the last N)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] | str = ("q_proj", "v_proj")
    dora: bool = False
    layers: int | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidSettingError(f"LoRA rank must be a positive integer, got {self.rank!r}; use --rank 8", "rank")
        if not 0 <= self.dropout < 1:
            raise InvalidSettingError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}", "dropout")
        if self.layers is not None and self.layers < 1:
            raise InvalidSettingError(f"the adapted layers must be at least 1, got {self.layers!r}", "layers")
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            object.__setattr__(self, "targets", (self.targets,))
        elif not isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise InvalidSettingError("no projections to adapt; name some (q_proj, v_proj) or all-linear", "targets")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear, NativeBlockLinear))


def linear_dims(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear map, packed (MLX's groups or GGUF's blocks) or not."""
    out_dims, width = base.weight.shape
    if isinstance(base, NativeBlockLinear):
        return base.in_dims, out_dims
    return (width * 32 // base.bits if isinstance(base, nn.QuantizedLinear) else width), out_dims


def base_weight(base: nn.Module) -> mx.array:
    """The (out, in) float weight of a linear map: a packed one dequantized."""
    if isinstance(base, NativeBlockLinear):
        return block_weight(base)
    if not isinstance(base, nn.QuantizedLinear):
        return base.weight
    biases = base.get("biases")
    scales = base.scales if biases is None else base.scales.astype(mx.float32)
    biases = None if biases is None else biases.astype(mx.float32)
    return mx.dequantize(base.weight, scales, biases, base.group_size, base.bits, mode=base.mode)


class LoRALinear(nn.Module):
    """A frozen linear map plus scale * B A (see the module docstring)."""

    def __init__(self, base: nn.Module, rank: int, scale: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.base.freeze()
        in_dims, out_dims = linear_dims(base)
        bound = 1 / math.sqrt(in_dims)  # PEFT's (and mlx-lm's) initial A: kaiming-uniform with a = sqrt(5)
        self.lora_a = mx.random.uniform(-bound, bound, (rank, in_dims))
        self.lora_b = mx.zeros((out_dims, rank))
        self.scale, self.dropout = scale, dropout

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def dropped(self, x: mx.array) -> mx.array:
        if not self.training or self.dropout == 0:
            return x
        keep = mx.random.bernoulli(1 - self.dropout, x.shape)
        return mx.where(keep, x / (1 - self.dropout), mx.zeros_like(x))

    def low_rank(self, x: mx.array) -> mx.array:
        """scale * x A^T B^T."""
        return (self.scale * (x @ self.lora_a.T)) @ self.lora_b.T

    def __call__(self, x: mx.array) -> mx.array:
        return self.base(x) + self.low_rank(self.dropped(x)).astype(x.dtype)

    def delta(self) -> mx.array:
        """What the adapter adds to the base's (out, in) weight: scale * B A."""
        return self.scale * (self.lora_b @ self.lora_a)

    def adapted_weight(self) -> mx.array:
        """W + scale * B A in float32 (a packed W dequantized)."""
        return base_weight(self.base).astype(mx.float32) + self.delta().astype(mx.float32)

    def fused_weight(self) -> mx.array:
        """The (out, in) float32 weight of base and adapter in one, for fusing; the bias stays the base's."""
        return self.adapted_weight()


class DoRALinear(LoRALinear):
    """LoRA with a learned per-row magnitude (PEFT's DoRA; see the module docstring)."""

    def __init__(self, base: nn.Module, rank: int, scale: float, dropout: float = 0.0):
        super().__init__(base, rank, scale, dropout)
        self.magnitude = self.weight_norm()

    def weight_norm(self) -> mx.array:
        """||W + scale B A|| of each output row, outside the gradient."""
        return mx.stop_gradient(mx.linalg.norm(self.adapted_weight(), axis=1))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        bias = self.base.get("bias")
        dropped = self.dropped(x)
        if dropped is x:  # PEFT reuses the base's product where dropout leaves x as it is
            product = y if bias is None else y - bias
        else:
            product = self.base(dropped) if bias is None else self.base(dropped) - bias
        ratio = (self.magnitude / self.weight_norm()).astype(x.dtype)
        return y + (ratio - 1) * product + ratio * self.low_rank(dropped).astype(x.dtype)

    def fused_weight(self) -> mx.array:
        weight = self.adapted_weight()
        return (self.magnitude / mx.linalg.norm(weight, axis=1))[:, None] * weight


ADAPTER_FORMS = (LoRALinear, DoRALinear)


def checkpoint_name(model: nn.Module, path: str) -> str:
    """The Hugging Face module name of the model's module at `path` (`layers.0.attn.q_proj` ->
    `model.layers.0.self_attn.q_proj`), by the family's `NameMap`."""
    return model.config.names.to_theirs({f"{path}.weight": None}).popitem()[0].removesuffix(".weight")


def layer_of(path: str) -> int | None:
    parts = path.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def targeted(model: nn.Module, settings: AdapterSettings) -> list[str]:
    """The module paths of the linear maps `settings` adapts, as PEFT matches `target_modules` on the Hugging Face
    names: a target names the last part(s) of a module's name."""
    parents = {path: module for path, module in model.named_modules()}
    first = len(model.layers) - settings.layers if settings.layers is not None else 0
    paths = []
    for path, module in model.named_modules():
        layer = layer_of(path)
        if not is_linear(module) or layer is None or layer < first:
            continue  # the head and embeddings are never adapted, nor anything outside the blocks
        if settings.targets == ALL_LINEAR:
            if not isinstance(parents.get(path.rpartition(".")[0]), Router):
                paths.append(path)
            continue
        name = checkpoint_name(model, path)
        if any(name == t or name.endswith(f".{t}") for t in settings.targets):
            paths.append(path)
    if not paths:
        raise InvalidSettingError(
            f"no linear map of this model matches the targets {settings.targets!r}; name Hugging Face projections "
            "such as q_proj, v_proj, down_proj, or all-linear",
            "targets",
        )
    return sorted(paths, key=lambda p: (layer_of(p), p))


def wrap(model: nn.Module, paths: list[str], settings: AdapterSettings) -> list[str]:
    """Wrap the linear maps at `paths` in the adapter form `settings` asks for; the rest of the model is frozen."""
    model.freeze()
    form = DoRALinear if settings.dora else LoRALinear
    modules = dict(model.named_modules())
    for path in paths:
        parent, _, name = path.rpartition(".")
        base = modules[path]
        if isinstance(base, ADAPTER_FORMS):
            raise InvalidSettingError(f"{path} already has an adapter; load the base model again to attach another")
        modules[parent][name] = form(base, settings.rank, settings.scale, settings.dropout)
    return paths


def attach(model: nn.Module, settings: AdapterSettings) -> list[str]:
    """Wrap the linear maps `settings` targets in `LoRALinear` (or `DoRALinear`), in place; freeze everything else.
    Returns the wrapped module paths (model names). The forms are in training mode (dropout on, as MLX modules
    start); `model.eval()` turns dropout off for inference."""
    return wrap(model, targeted(model, settings), settings)


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's adapter forms by module path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, ADAPTER_FORMS)}


@contextmanager
def detached(model: nn.Module) -> Iterator[nn.Module]:
    """The base model in the adapted one's place for the length of the block: each adapter form's `base` put back
    where the form wraps it, the forms restored afterwards (to trace or run the base and the adapted model on the
    same prompt from one copy of the weights)."""
    forms = adapters(model)
    if not forms:
        raise InvalidSettingError("the model has no adapter to detach; load it with adapter=PATH (--adapter)")
    model.update_modules(tree_unflatten([(path, form.base) for path, form in forms.items()]))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(list(forms.items())))


def adapter_weights(model: nn.Module) -> dict[str, mx.array]:
    """The adapters' parameters under model names: `<path>.lora_a` (rank, in), `<path>.lora_b` (out, rank) and, for
    DoRA, `<path>.magnitude` (out,)."""
    return {
        f"{path}.{name}": value
        for path, module in adapters(model).items()
        for name, value in tree_flatten(module.trainable_parameters())
    }


def fused_weights(model: nn.Module) -> dict[str, mx.array]:
    """Each adapted map's (out, in) float weight with its adapter folded in, under `<path>.weight`."""
    return {f"{path}.weight": module.fused_weight() for path, module in adapters(model).items()}
