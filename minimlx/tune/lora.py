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

`LoRAExperts` adapts a mixture's routed experts as PEFT's `ParamWrapper` adapts transformers' stacked expert
parameters (PEFT's `target_parameters`: `gate_up_proj`, (experts, 2 * hidden, dims), and `down_proj`, (experts, dims,
hidden)): each expert e has its own low-rank change scale * B_e A_e of the stacked matrix, A (experts, rank, in) and
B (experts, out, rank), so a token adds scale * x A_e^T B_e^T for each expert e it is routed to. minimlx holds gate
and up apart, so the change of `gate_up_proj` is one A_e for both and a B_e whose first `hidden` rows change the
gate, the rest the up projection. mlx-lm's `LoRASwitchLinear` adapts each stacked projection of its `switch_mlp`
apart (`gate_proj`, `up_proj`, `down_proj`, the same per-expert A and B): `LoRAExperts` holds those too, as an
mlx-lm adapter folder has them.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..core import Experts, Router
from ..core.quantized import QuantizedWeight
from ..cpu.linear import BlockWeight, NativeBlockLinear, block_dequantizer
from ..decode.adapters import EXPERT_PROJECTIONS
from ..errors import InvalidSettingError

ALL_LINEAR = "all-linear"
# transformers' stacked expert parameters, in the order its expert modules define them (PEFT nests its wrappers so)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
SPLIT_PROJECTIONS = ("gate_proj", "up_proj")  # mlx-lm's gate and up projections adapted apart: PEFT cannot hold them
EXPERTS, ALL = "experts", "all"  # --targets' names for the experts' stacked projections, and for those and all-linear


@dataclass(frozen=True)
class AdapterSettings:
    """What an adapter is: its rank, alpha (scale = alpha / rank), dropout on the adapter's input, the projections it
    adapts (Hugging Face's names, or "all-linear": every linear map of the blocks but the routers, as PEFT's
    `all-linear` on dense models), the stacked expert projections it adapts (`experts`, PEFT's `target_parameters`:
    gate_up_proj, down_proj, or mlx-lm's gate_proj, up_proj, down_proj; neither adapts them with DoRA, and PEFT
    without dropout), DoRA or plain LoRA, and the layers it
    covers (None: all; N: the last N)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] | str = ("q_proj", "v_proj")
    dora: bool = False
    layers: int | None = None
    experts: tuple[str, ...] = ()

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
        experts = (self.experts,) if isinstance(self.experts, str) else tuple(self.experts)
        unknown = sorted(set(experts) - set(EXPERT_PROJECTIONS))
        if unknown:
            raise InvalidSettingError(
                f"the experts have no stacked projection {unknown[0]!r}; name {' or '.join(EXPERT_PARAMETERS)}",
                "targets",
            )
        object.__setattr__(self, "experts", tuple(p for p in EXPERT_PROJECTIONS if p in experts))
        if not self.targets and not self.experts:
            raise InvalidSettingError("no projections to adapt; name some (q_proj, v_proj) or all-linear", "targets")
        peft_form = not set(self.experts) & set(SPLIT_PROJECTIONS)  # mlx-lm's form takes dropout
        if self.experts and (self.dora or (self.dropout and peft_form)):
            raise InvalidSettingError(
                f"adapters of the experts take {'no DoRA' if self.dora else 'no dropout'} (PEFT's cannot hold "
                "one); adapt the experts with plain LoRA and --dropout 0",
                "targets",
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def named_targets(names: str) -> dict:
    """`--targets` as `AdapterSettings`' fields: Hugging Face projection names separated by commas (`experts` among
    them for the routed experts' stacked projections), all-linear, or all (all-linear and the experts, where the
    model has them)."""
    names = names.strip()
    if names == ALL:
        return {"targets": ALL_LINEAR, "experts": EXPERT_PARAMETERS}
    if names == ALL_LINEAR:
        return {"targets": ALL_LINEAR}
    listed = [name.strip() for name in names.split(",") if name.strip()]
    return {
        "targets": tuple(name for name in listed if name != EXPERTS),
        "experts": EXPERT_PARAMETERS if EXPERTS in listed else (),
    }


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear, NativeBlockLinear))


def linear_dims(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear map, packed (MLX's groups or GGUF's blocks) or not."""
    out_dims, width = base.weight.shape
    if isinstance(base, NativeBlockLinear):
        return base.in_dims, out_dims
    return (width * 32 // base.bits if isinstance(base, nn.QuantizedLinear) else width), out_dims


def base_weight(base: nn.Module, rows: slice | None = None) -> mx.array:
    """The (out, in) float weight of a linear map or embedding (a stacked (experts, out, in) one of a core part), or
    `rows` of it: a packed one dequantized, outside the gradient."""
    if isinstance(base, BlockWeight):
        packed = base.weight if rows is None else base.weight[rows]
        return mx.stop_gradient(block_dequantizer(base)(packed))
    if not isinstance(base, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedWeight)):
        return base.weight if rows is None else base.weight[rows]
    rows = rows or slice(None)
    biases = base.get("biases")
    scales = base.scales[rows] if biases is None else base.scales[rows].astype(mx.float32)
    biases = None if biases is None else biases[rows].astype(mx.float32)
    return mx.dequantize(base.weight[rows], scales, biases, base.group_size, base.bits, mode=base.mode)


def dropped(x: mx.array, rate: float) -> mx.array:
    """x with a `rate` of its entries zeroed at random, the rest scaled up to keep its mean (x itself at rate 0)."""
    if rate == 0:
        return x
    keep = mx.random.bernoulli(1 - rate, x.shape)
    return mx.where(keep, x / (1 - rate), mx.zeros_like(x))


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
        return dropped(x, self.dropout if self.training else 0.0)

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


class ExpertLowRank(nn.Module):
    """One stacked expert projection's adapter: each expert e's rows add scale * x A_e^T B_e^T, `lora_a` (experts,
    rank, in) and `lora_b` (experts, out, rank), PEFT's `ParamWrapper` factors per expert, each gathered for its
    rows inside the matrix product (`mx.gather_mm`, as the base's). `dropout` (mlx-lm's; PEFT's takes none) drops
    entries of the rows the adapter reads while training."""

    def __init__(self, num_experts: int, in_dims: int, out_dims: int, rank: int, scale: float, dropout: float = 0.0):
        super().__init__()
        bound = 1 / math.sqrt(in_dims)  # PEFT's initial A, as for a linear map
        self.lora_a = mx.random.uniform(-bound, bound, (num_experts, rank, in_dims))
        self.lora_b = mx.zeros((num_experts, out_dims, rank))
        self.scale, self.dropout = scale, dropout

    def __call__(self, rows: mx.array, expert_indices: mx.array, sorted_indices: bool) -> mx.array:
        """rows (..., 1, in), each with its expert in `expert_indices` -> scale * x A_e^T B_e^T (..., 1, out)."""
        rows = dropped(rows, self.dropout if self.training else 0.0)
        low = mx.gather_mm(
            rows, self.lora_a.swapaxes(-1, -2), rhs_indices=expert_indices, sorted_indices=sorted_indices
        )
        return mx.gather_mm(
            self.scale * low, self.lora_b.swapaxes(-1, -2), rhs_indices=expert_indices, sorted_indices=sorted_indices
        )

    def delta(self) -> mx.array:
        """What the adapter adds to the stacked (experts, out, in) weight: scale * B_e A_e for each expert."""
        return self.scale * (self.lora_b @ self.lora_a)


def expert_dims(base: nn.Module) -> tuple[int, int, int]:
    """(experts, in, out) of a stacked expert projection, packed or not."""
    num_experts, out_dims, width = base.weight.shape
    return num_experts, (width * 32 // base.bits if isinstance(base, QuantizedWeight) else width), out_dims


def projection_dims(experts: Experts) -> dict[str, tuple[int, int]]:
    """(in, out) of each stacked projection of `experts` an adapter can change (`EXPERT_PROJECTIONS`)."""
    _, dims, hidden = expert_dims(experts.gate_proj)
    pairs = {"gate_up_proj": (dims, 2 * hidden), "gate_proj": (dims, hidden), "up_proj": (dims, hidden)}
    return pairs | {"down_proj": (hidden, dims)}


class LoRAExperts(nn.Module):
    """Routed experts (core's `Experts`, their weights float or packed, frozen) with adapters of their stacked
    projections (`EXPERT_PROJECTIONS`: PEFT's `gate_up_proj` and `down_proj`, mlx-lm's `gate_proj`, `up_proj` and
    `down_proj`; see the module docstring): gate, up and down computed as the base computes them, each plus its
    expert's low-rank change."""

    def __init__(self, base: Experts, parameters: tuple[str, ...], rank: int, scale: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.base.freeze()
        num_experts, dims = base.gate_proj.weight.shape[0], projection_dims(base)
        for parameter in parameters:
            self[parameter] = ExpertLowRank(num_experts, *dims[parameter], rank, scale, dropout)

    @property
    def adapted(self) -> tuple[str, ...]:
        """The stacked projections adapted, in `EXPERT_PROJECTIONS`' order."""
        return tuple(p for p in EXPERT_PROJECTIONS if p in self)

    @property
    def rank(self) -> int:
        return self[self.adapted[0]].lora_a.shape[1]

    @property
    def scale(self) -> float:
        return self[self.adapted[0]].scale

    def __call__(self, x: mx.array, expert_indices: mx.array, per_choice: bool = False) -> mx.array:
        base = self.base
        rows, indices, order = base.grouped(x, expert_indices, per_choice)
        sort = order is not None
        gate, up = base.gate_proj(rows, indices, sort), base.up_proj(rows, indices, sort)
        if "gate_up_proj" in self:
            gate_change, up_change = mx.split(self.gate_up_proj(rows, indices, sort).astype(gate.dtype), 2, axis=-1)
            gate, up = gate + gate_change, up + up_change
        if "gate_proj" in self:
            gate = gate + self.gate_proj(rows, indices, sort).astype(gate.dtype)
        if "up_proj" in self:
            up = up + self.up_proj(rows, indices, sort).astype(up.dtype)
        hidden = base.activation(gate, up)
        out = base.down_proj(hidden, indices, sort)
        if "down_proj" in self:
            out = out + self.down_proj(hidden, indices, sort).astype(out.dtype)
        return base.ungrouped(out, order, expert_indices.shape)

    def fused_weights(self) -> dict[str, mx.array]:
        """The adapted projections' stacked (experts, out, in) float32 weights with the adapters folded in, by the
        name of the base's projection (gate_proj, up_proj, down_proj)."""
        fused = {}
        for parameter in self.adapted:
            delta = self[parameter].delta().astype(mx.float32)
            gate_up = parameter == "gate_up_proj"  # its first half changes the gate, the rest the up projection
            parts = dict(zip(SPLIT_PROJECTIONS, mx.split(delta, 2, axis=1))) if gate_up else {parameter: delta}
            for name, change in parts.items():
                fused[name] = fused.get(name, base_weight(self.base[name]).astype(mx.float32)) + change
        return fused


def checkpoint_name(model: nn.Module, path: str) -> str:
    """The Hugging Face module name of the model's module at `path` (`layers.0.attn.q_proj` ->
    `model.layers.0.self_attn.q_proj`), by the family's `NameMap`."""
    return model.config.names.to_theirs({f"{path}.weight": None}).popitem()[0].removesuffix(".weight")


def layer_of(path: str) -> int | None:
    parts = path.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def first_layer(model: nn.Module, settings: AdapterSettings) -> int:
    return len(model.layers) - settings.layers if settings.layers is not None else 0


def targeted(model: nn.Module, settings: AdapterSettings) -> list[str]:
    """The module paths of the linear maps `settings` adapts, as PEFT matches `target_modules` on the Hugging Face
    names: a target names the last part(s) of a module's name."""
    if not settings.targets:
        return []
    parents = {path: module for path, module in model.named_modules()}
    first = first_layer(model, settings)
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


def targeted_experts(model: nn.Module, settings: AdapterSettings) -> list[str]:
    """The module paths of the routed experts (core's `Experts`) whose stacked projections `settings` adapts."""
    if not settings.experts:
        return []
    first = first_layer(model, settings)
    paths = [
        path
        for path, module in model.named_modules()
        if isinstance(module, Experts) and layer_of(path) is not None and layer_of(path) >= first
    ]
    if not paths and settings.targets != ALL_LINEAR:  # all-linear with the experts: the experts where there are any
        raise InvalidSettingError(
            "this model has no routed experts in the adapted layers to adapt; drop experts from the targets", "targets"
        )
    return sorted(paths, key=lambda p: (layer_of(p), p))


def wrap_experts(model: nn.Module, adapted: dict[str, tuple[str, ...]], settings: AdapterSettings) -> list[str]:
    """Wrap the routed experts at each path of `adapted` in `LoRAExperts` adapting the stacked projections it names
    (their base frozen; `wrap`, called first, froze the rest of the model)."""
    modules = dict(model.named_modules())
    for path, parameters in adapted.items():
        parent, _, name = path.rpartition(".")
        if isinstance(modules[path], LoRAExperts):
            raise InvalidSettingError(f"{path} already has an adapter; load the base model again to attach another")
        modules[parent][name] = LoRAExperts(modules[path], parameters, settings.rank, settings.scale, settings.dropout)
    return list(adapted)


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
    start); `model.eval()` turns dropout off for inference. The routed experts `settings.experts` adapts are wrapped
    in `LoRAExperts` (their paths follow the linear maps')."""
    linear, experts = targeted(model, settings), targeted_experts(model, settings)
    return wrap(model, linear, settings) + wrap_experts(model, dict.fromkeys(experts, settings.experts), settings)


def expert_adapters(model: nn.Module) -> dict[str, LoRAExperts]:
    """The model's adapted routed experts by module path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRAExperts)}


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
    DoRA, `<path>.magnitude` (out,); for adapted experts at `<path>`, `<path>.gate_up_proj.lora_a` (experts, rank,
    in), `<path>.gate_up_proj.lora_b` (experts, out, rank), and the same of `down_proj`."""
    forms = adapters(model) | expert_adapters(model)
    return {
        f"{path}.{name}": value
        for path, module in forms.items()
        for name, value in tree_flatten(module.trainable_parameters())
    }


def fused_weights(model: nn.Module) -> dict[str, mx.array]:
    """Each adapted map's (out, in) float weight with its adapter folded in, under `<path>.weight`; each adapted
    experts' stacked projections under `<path>.gate_proj.weight` and so on."""
    fused = {f"{path}.weight": module.fused_weight() for path, module in adapters(model).items()}
    for path, module in expert_adapters(model).items():
        fused |= {f"{path}.{name}.weight": weight for name, weight in module.fused_weights().items()}
    return fused
