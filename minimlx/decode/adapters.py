"""Adapters per row: one model serving several LoRA or DoRA adapters at once, each row of a batch with its own (or
none), as vLLM's multi-LoRA serving does and llama.cpp's hot-swapped adapters cannot.

Every linear map some adapter changes becomes a `RowAdaptedLinear`: its base map, kept as it is (packed weights stay
packed), and each adapter's low-rank factors stacked along a first axis, index 0 a zero adapter that stands for the
base model and the ranks padded with zeros to the largest. A forward pass gathers each row's factors and adds its own
low-rank product to the base map's output; a DoRA adapter also rescales each output feature (its magnitude over the
norm of its adapted weight's row), a LoRA adapter or the base by one. `AdapterRows` says which adapter each row of
the next passes uses: the runner sets it before every pass, from each row's request.

Routed experts some adapter changes (`ExpertsLowRank`, PEFT's adapters of the stacked expert projections) become
`RowAdaptedExperts` the same way: each adapter's per-expert factors stacked after a zero adapter, adapter-major, so
that a (token, expert) pair of a row of adapter i uses stacked factors i * experts + expert.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import InvalidSettingError

# the stacked expert projections an adapter can change: PEFT's gate_up_proj (gate rows, then up rows) and down_proj,
# mlx-lm's gate_proj, up_proj and down_proj each apart
EXPERT_PROJECTIONS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LowRank:
    """One adapter's change to one linear map y = base(x): `y + scale * (x @ a.T) @ b.T` (PEFT's order of products),
    `a` (rank, inputs), `b` (outputs, rank), `scale` alpha / rank; with a DoRA adapter's `rescale` (outputs,), its
    magnitude over the norm of each row of its adapted weight, the whole of it but the bias times that."""

    a: mx.array
    b: mx.array
    scale: float
    rescale: mx.array | None = None


@dataclass
class ExpertsLowRank:
    """One adapter's change to routed experts: for each stacked projection it adapts (`EXPERT_PROJECTIONS`, as
    `tune.LoRAExperts`), its factors `(a, b)`, a (experts, rank, in) and b (experts, out, rank): expert e's rows add
    `scale * (x @ a[e].T) @ b[e].T`."""

    factors: dict[str, tuple[mx.array, mx.array]]
    scale: float


class AdapterRows:
    """Which adapter each row of the next forward passes uses: `index` (rows,) into the stacked adapters, 0 for the
    base model; None when every row is on the base (the adapted maps then add nothing)."""

    def __init__(self):
        self.index: mx.array | None = None


class RowAdaptedLinear(nn.Module):
    """A linear map (any form: float, packed, the CPU's) plus, per row, the low-rank product of that row's adapter.

    `lora_a` (adapters + 1, inputs, rank) and `lora_b` (adapters + 1, rank, outputs), each adapter's factors
    transposed, `lora_scale` (adapters + 1,) and `lora_rescale` (adapters + 1, outputs) where some adapter is DoRA
    hold every adapter's `LowRank`, index 0 zeros (and ones); `rows` is shared by all the model's adapted maps. The
    products gather each row's factors inside the matrix product (`mx.gather_mm`, as vLLM's punica kernels do),
    without copying them out first."""

    def __init__(self, base: nn.Module, a, b, scale, rescale, rows: AdapterRows):
        super().__init__()
        self.base, self.lora_a, self.lora_b, self.lora_scale = base, a, b, scale
        if rescale is not None:
            self.lora_rescale = rescale
        self.rows = rows

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        index = self.rows.index
        if index is None:
            return y
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, inputs)
        low = self.lora_scale[index][:, None, None] * mx.gather_mm(flat, self.lora_a, rhs_indices=index)
        low = mx.gather_mm(low, self.lora_b, rhs_indices=index)
        low = low.reshape(y.shape).astype(y.dtype)
        if "lora_rescale" not in self:
            return y + low
        ratio = self.lora_rescale[index].reshape(x.shape[0], *[1] * (y.ndim - 2), -1).astype(y.dtype)
        bias = self.base["bias"] if "bias" in self.base else 0
        return ratio * (y - bias + low) + bias


class RowAdaptedExperts(nn.Module):
    """Routed experts (core's `Experts`, float or packed) plus, per row, its adapter's change of each (token, expert)
    pair. `lora_a[name]` ((adapters + 1) * experts, in, rank) and `lora_b[name]` ((adapters + 1) * experts, rank,
    out) hold every adapter's factors of the stacked projection `name` (gate_up_proj: gate then up), `lora_scale`
    (adapters + 1,) their scales, index 0 zeros."""

    def __init__(self, base: nn.Module, a: dict, b: dict, scale: mx.array, rows: AdapterRows):
        super().__init__()
        self.base, self.lora_a, self.lora_b, self.lora_scale, self.rows = base, a, b, scale, rows

    def __call__(self, x: mx.array, expert_indices: mx.array, per_choice: bool = False) -> mx.array:
        base, index = self.base, self.rows.index
        if index is None:
            return base(x, expert_indices, per_choice)
        rows, indices, order = base.grouped(x, expert_indices, per_choice)
        sort = order is not None
        adapter = mx.broadcast_to(index.reshape(-1, *[1] * (expert_indices.ndim - 1)), expert_indices.shape)
        pairs, scale = adapter * base.gate_proj.weight.shape[0] + expert_indices, self.lora_scale[adapter]
        if sort:
            pairs, scale = pairs.flatten()[order], scale.flatten()[order]
        scale = scale[..., None, None]

        def change(name: str, inputs: mx.array) -> mx.array:
            low = mx.gather_mm(inputs, self.lora_a[name], rhs_indices=pairs)
            return (scale * mx.gather_mm(low, self.lora_b[name], rhs_indices=pairs)).astype(inputs.dtype)

        gate, up = base.gate_proj(rows, indices, sort), base.up_proj(rows, indices, sort)
        if "gate_up_proj" in self.lora_a:
            gate_change, up_change = mx.split(change("gate_up_proj", rows), 2, axis=-1)
            gate, up = gate + gate_change, up + up_change
        if "gate_proj" in self.lora_a:
            gate = gate + change("gate_proj", rows)
        if "up_proj" in self.lora_a:
            up = up + change("up_proj", rows)
        hidden = base.activation(gate, up)
        out = base.down_proj(hidden, indices, sort)
        if "down_proj" in self.lora_a:
            out = out + change("down_proj", hidden)
        return base.ungrouped(out, order, expert_indices.shape)


class Adapters:
    """The adapters one model serves, by name: each adapted map of `model` made a `RowAdaptedLinear` holding all of
    them. `adapters` maps each name to its changes, `{module path: LowRank}` (paths as `model.named_modules()` gives
    them); a map one adapter leaves alone holds zeros for it."""

    def __init__(self, model: nn.Module, adapters: dict[str, dict[str, LowRank | ExpertsLowRank]]):
        if not adapters:
            raise InvalidSettingError("no adapters given; pass at least one NAME=PATH")
        self.names = list(adapters)
        self.rows = AdapterRows()
        modules = dict(model.named_modules())
        paths = sorted({path for changes in adapters.values() for path in changes})
        unknown = [path for path in paths if path not in modules]
        if unknown:
            raise InvalidSettingError(f"the adapters change {unknown[0]}, which the model does not have")
        replaced = []
        for path in paths:
            changes = [adapters[name].get(path) for name in self.names]
            given = next(c for c in changes if c is not None)
            stack = self.stacked_experts if isinstance(given, ExpertsLowRank) else self.stacked
            replaced.append((path, stack(modules[path], changes)))
        model.update_modules(tree_unflatten(replaced))
        # what the adapters hold (a DoRA map's magnitude as many numbers as its rescale), not the padded stacks
        self.parameter_count = sum(
            sum(a.size + b.size for a, b in c.factors.values())
            if isinstance(c, ExpertsLowRank)
            else c.a.size + c.b.size + (c.rescale.size if c.rescale is not None else 0)
            for changes in adapters.values()
            for c in changes.values()
        )
        self.held: tuple[list, mx.array | None] | None = None  # the names last selected, and their index

    def stacked(self, base: nn.Module, changes: list[LowRank | None]) -> RowAdaptedLinear:
        """The adapted form of `base`: the adapters' factors stacked after a zero adapter, ranks padded to the
        largest."""
        given = [c for c in changes if c is not None]
        rank = max(c.a.shape[0] for c in given)
        inputs, outputs, dtype = given[0].a.shape[1], given[0].b.shape[0], given[0].a.dtype
        a, b = [mx.zeros((rank, inputs), dtype)], [mx.zeros((outputs, rank), dtype)]
        for c in changes:
            padding = rank - (c.a.shape[0] if c is not None else 0)
            a.append(
                mx.zeros((rank, inputs), dtype) if c is None else mx.pad(c.a.astype(dtype), [(0, padding), (0, 0)])
            )
            b.append(
                mx.zeros((outputs, rank), dtype) if c is None else mx.pad(c.b.astype(dtype), [(0, 0), (0, padding)])
            )
        scale = mx.array([0.0] + [0.0 if c is None else c.scale for c in changes], dtype=dtype)
        rescale = None
        if any(c.rescale is not None for c in given):
            ones = mx.ones((outputs,), dtype)
            rescale = mx.stack([ones] + [ones if c is None or c.rescale is None else c.rescale for c in changes])
        a, b = mx.contiguous(mx.stack(a).swapaxes(-1, -2)), mx.contiguous(mx.stack(b).swapaxes(-1, -2))
        return RowAdaptedLinear(base, a, b, scale, rescale, self.rows)

    def stacked_experts(self, base: nn.Module, changes: list[ExpertsLowRank | None]) -> RowAdaptedExperts:
        """The adapted form of routed experts: each stacked projection's per-expert factors of every adapter, a zero
        adapter first, ranks padded to the largest, transposed for the products."""
        given = [c for c in changes if c is not None]
        names = [n for n in EXPERT_PROJECTIONS if any(n in c.factors for c in given)]
        a, b = {}, {}
        for name in names:
            shaped = [c.factors[name] for c in given if name in c.factors]
            rank = max(fa.shape[1] for fa, _ in shaped)
            (experts, _, inputs), outputs, dtype = shaped[0][0].shape, shaped[0][1].shape[1], shaped[0][0].dtype
            zero = (mx.zeros((experts, rank, inputs), dtype), mx.zeros((experts, outputs, rank), dtype))
            stacks = [zero]
            for c in changes:
                fa, fb = zero if c is None or name not in c.factors else c.factors[name]
                padding = rank - fa.shape[1]
                stacks.append(
                    (
                        mx.pad(fa.astype(dtype), [(0, 0), (0, padding), (0, 0)]),
                        mx.pad(fb.astype(dtype), [(0, 0), (0, 0), (0, padding)]),
                    )
                )
            a[name] = mx.contiguous(mx.concatenate([fa for fa, _ in stacks]).swapaxes(-1, -2))
            b[name] = mx.contiguous(mx.concatenate([fb for _, fb in stacks]).swapaxes(-1, -2))
        dtype = given[0].factors[names[0]][0].dtype
        scale = mx.array([0.0] + [0.0 if c is None else c.scale for c in changes], dtype=dtype)
        return RowAdaptedExperts(base, a, b, scale, self.rows)

    def index_of(self, name: str | None) -> int:
        """The stacked index of adapter `name` (0: the base model, for None)."""
        if name is None:
            return 0
        if name not in self.names:
            served = ", ".join(self.names)
            raise InvalidSettingError(f"no adapter named {name!r} is served; the adapters are: {served}", "adapter")
        return self.names.index(name) + 1

    def select(self, names: list[str | None]) -> None:
        """The next passes run rows whose adapters are `names` (None: the base), in row order."""
        if self.held is None or self.held[0] != names:
            indices = [self.index_of(name) for name in names]
            self.held = (list(names), mx.array(indices, dtype=mx.int32) if any(indices) else None)
        self.rows.index = self.held[1]
