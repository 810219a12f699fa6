"""Mixtures of experts: the settings a family's config gives them, and their tensors as checkpoints store them.

`MoEConfig` builds core's `MoE` from a family's settings; `stack_experts` turns per-expert (or fused) checkpoint
tensors into the stacked `(num_experts, out, in)` weights of core's `Experts`; `ExpertsLayout` is what a family declares
about how its Hugging Face checkpoints (and transformers' modules) hold the experts' fused `gate_up_proj`.
"""

import re
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..core import Experts, MoE, Router, SwiGLU, clamped_swiglu, is_moe_layer
from ..core.ffn import ACTIVATIONS
from ..core.moe import glu, swiglu
from ..core.norms import RMSNorm


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the dense FFN: how many experts, how wide, how the router picks them (core's
    `Router` says what each setting does), a shared expert beside them, and the layers that have one."""

    num_experts: int
    experts_per_token: int
    ffn_dims: int  # each routed expert's hidden width
    scoring: str = "softmax"
    normalize: bool = False
    groups: int = 1
    groups_kept: int = 1
    group_top: int = 1
    score_bias: bool = False
    scale: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # set: the experts' activation is `clamped_swiglu` (gpt-oss), else SwiGLU
    swiglu_alpha: float = 1.702
    shared_ffn_dims: int = 0  # a SwiGLU that every token passes through beside the routed experts (0: none)
    shared_gate: bool = False  # its output scaled per token by sigmoid(shared_gate(x))
    weighted_inputs: bool = False  # each expert reads the token times its weight (core's MoE says more)
    first_dense: int = (
        0  # layers keep the dense FFN before this one, off the `every`/`phase` beat and in `dense_layers`
    )
    every: int = 1
    phase: int = 0
    dense_layers: tuple[int, ...] = ()
    activation: str = "silu"  # of the experts' gate (with no `swiglu_limit`)
    input_norm_eps: float | None = None  # set: the router reads x RMS-normed and scaled, the experts an RMSNorm of x
    expert_scale: bool = False  # each chosen weight times its expert's learned scale

    def covers(self, layer: int) -> bool:
        return is_moe_layer(layer, self.first_dense, self.every, self.phase, self.dense_layers)

    def build(self, dims: int, bias: bool) -> MoE:
        """The router, the experts and the shared expert (a SwiGLU with `bias`) of a model `dims` wide."""
        router = Router(
            dims,
            self.num_experts,
            self.experts_per_token,
            self.scoring,
            self.normalize,
            self.groups,
            self.groups_kept,
            self.group_top,
            self.score_bias,
            self.scale,
            self.router_bias,
            self.input_norm_eps,
            self.expert_scale,
        )
        limit, alpha = self.swiglu_limit, self.swiglu_alpha
        if limit is not None:
            activation = partial(clamped_swiglu, alpha=alpha, limit=limit)
        else:
            activation = swiglu if self.activation == "silu" else partial(glu, activation=ACTIVATIONS[self.activation])
        experts = Experts(dims, self.ffn_dims, self.num_experts, self.expert_bias, activation)
        if not self.shared_ffn_dims:
            norm = RMSNorm(dims, self.input_norm_eps) if self.input_norm_eps is not None else None
            return MoE(router, experts, weighted_inputs=self.weighted_inputs, input_norm=norm)
        gate = nn.Linear(dims, 1, bias=False) if self.shared_gate else None
        return MoE(router, experts, SwiGLU(dims, self.shared_ffn_dims, bias=bias), gate, self.weighted_inputs)


@dataclass(frozen=True)
class ExpertsLayout:
    """How a family's Hugging Face checkpoints stack the experts' projections: each `(experts, out, in)` or, when
    `transposed`, `(experts, in, out)`; the fused `gate_up_proj`'s outputs all the gate's first, then the up
    projection's, or, when `interleaved`, alternating (gate, up, gate, up, ...). transformers keeps the same layout in
    memory, so PEFT's adapters of `gate_up_proj` (`target_parameters`) order their outputs so too. PEFT's
    `ParamWrapper` reads the stacked weights as (experts, out, in) unless transformers' module is `flagged` as
    transposed (gpt-oss's is; Llama 4's is not)."""

    transposed: bool = False
    interleaved: bool = False
    flagged: bool = True

    @property
    def peft_swapped(self) -> bool:
        """Whether PEFT takes each stacked weight's inputs for its outputs (transposed, not flagged so): its adapter's
        A then reads the projection's outputs and its B its inputs."""
        return self.transposed and not self.flagged

    def stored(self, weight: mx.array) -> mx.array:
        """A stacked float weight, (experts, out, in), as the checkpoints store it, and back (its own inverse)."""
        return weight.swapaxes(-1, -2) if self.transposed else weight

    def split_gate_up(self, fused: mx.array, axis: int) -> tuple[mx.array, mx.array]:
        """(gate, up) of the fused gate_up outputs along `axis` (counted from the front)."""
        outputs = mx.moveaxis(fused, axis, 0)
        half = outputs.shape[0] // 2
        gate, up = (outputs[::2], outputs[1::2]) if self.interleaved else (outputs[:half], outputs[half:])
        return mx.contiguous(mx.moveaxis(gate, 0, axis)), mx.contiguous(mx.moveaxis(up, 0, axis))

    def fuse_gate_up(self, gate: mx.array, up: mx.array, axis: int) -> mx.array:
        """`split_gate_up` undone: gate and up outputs along `axis` (counted from the front) fused in this layout."""
        if not self.interleaved:
            return mx.concatenate([gate, up], axis=axis)
        return mx.stack([gate, up], axis=axis + 1).flatten(axis, axis + 1)


GATE_FIRST = ExpertsLayout()  # qwen3_moe, mixtral, olmoe, ...: (experts, out, in), gate rows then up rows

PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|scales|biases)$")
FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint expert tensors -> the stacked `experts.{gate,up,down}_proj.weight` of `Experts`.

    Accepts per-expert tensors `...experts.{e}.{proj}.weight` (what published checkpoints hold; quantized ones with
    their `scales` and `biases`), and the fused `...experts.gate_up_proj` (num_experts, 2 * hidden, dims) and
    `...experts.down_proj` (num_experts, dims, hidden) that transformers 5 keeps in memory.
    """
    out, per_expert = {}, {}
    for name, w in weights.items():
        if m := PER_EXPERT.match(name):
            per_expert.setdefault(f"{m[1]}.{m[3]}.{m[4]}", {})[int(m[2])] = w
        elif m := FUSED.match(name):
            if m[2] == "gate_up_proj":
                out[f"{m[1]}.gate_proj.weight"], out[f"{m[1]}.up_proj.weight"] = GATE_FIRST.split_gate_up(w, axis=1)
            else:
                out[f"{m[1]}.down_proj.weight"] = w
        else:
            out[name] = w
    for name, experts in per_expert.items():
        out[name] = mx.stack([experts[e] for e in sorted(experts)])
    return out
