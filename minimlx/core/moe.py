"""Mixture of experts: a router sends each token to a few of many SwiGLU experts.

The experts' weights are stacked, `(num_experts, out, in)` per projection, and every token's
chosen experts are applied with `mx.gather_mm`: one gathered matmul per projection for the
whole batch, however many experts there are. Shared experts, when present, see every token.
"""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from .ffn import SwiGLU
from .quantized import QuantizedWeight


def is_moe_layer(layer: int, first_dense: int = 0, every: int = 1, phase: int = 0, dense: tuple = ()) -> bool:
    """Whether layer `layer` is a mixture of experts: from `first_dense` on, when `layer % every == phase`,
    unless listed in `dense` (the other layers keep a dense FFN)."""
    return layer >= first_dense and layer % every == phase and layer not in dense


class Router(nn.Module):
    """Scores the experts for each token and picks `experts_per_token` of them.

    Scores are a softmax or an element-wise sigmoid of `weight @ x` (`+ bias` with `logit_bias`). With
    `groups > 1` the experts form equal groups, each ranked by the sum of its `group_top` best scores, and only
    experts of the `groups_kept` best groups can be chosen. `score_bias` shifts the scores used for choosing only;
    the weights of the chosen experts are the unshifted scores, renormalised to sum to 1 when
    `normalize`, then multiplied by `scale`. With `input_norm_eps`, the router reads x RMS-normed, times a learned
    `input_scale` per feature and 1/sqrt(dims); with `expert_scale`, each chosen weight is multiplied by its expert's
    learned `expert_scale`.
    """

    def __init__(
        self,
        dims: int,
        num_experts: int,
        experts_per_token: int,
        scoring: str = "softmax",
        normalize: bool = False,
        groups: int = 1,
        groups_kept: int = 1,
        group_top: int = 1,
        score_bias: bool = False,
        scale: float = 1.0,
        logit_bias: bool = False,
        input_norm_eps: float | None = None,
        expert_scale: bool = False,
    ):
        super().__init__()
        if input_norm_eps is not None:
            self.input_scale = mx.ones((dims,))
        self.input_norm_eps = input_norm_eps
        if expert_scale:
            self.expert_scale = mx.ones((num_experts,))
        self.dims = dims
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported expert scoring {scoring!r}; supported: softmax, sigmoid")
        self.proj = nn.Linear(dims, num_experts, bias=logit_bias)
        self.num_experts = num_experts
        if score_bias:
            self.score_bias = mx.zeros((num_experts,))
        self.experts_per_token = experts_per_token
        self.scoring, self.normalize, self.scale = scoring, normalize, scale
        self.groups, self.groups_kept, self.group_top = groups, groups_kept, group_top

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x: (..., dims) -> expert_indices (..., k) int, expert_weights (..., k) float32."""
        if "input_scale" in self:
            x = mx.fast.rms_norm(x, self.input_scale * self.dims**-0.5, self.input_norm_eps)
        logits = self.proj(x).astype(mx.float32)
        scores = mx.sigmoid(logits) if self.scoring == "sigmoid" else mx.softmax(logits, axis=-1)
        choice = scores + self.score_bias.astype(mx.float32) if "score_bias" in self else scores
        if self.groups > 1:
            grouped = choice.reshape(*choice.shape[:-1], self.groups, -1)
            group_scores = mx.topk(grouped, self.group_top, axis=-1).sum(axis=-1)
            threshold = mx.topk(group_scores, self.groups_kept, axis=-1).min(axis=-1, keepdims=True)
            choice = mx.where((group_scores >= threshold)[..., None], grouped, -mx.inf).reshape(choice.shape)
        k = self.experts_per_token
        expert_indices = mx.stop_gradient(mx.argpartition(-choice, k - 1, axis=-1)[..., :k])  # a choice: no gradient
        expert_weights = mx.take_along_axis(scores, expert_indices, axis=-1)
        if self.normalize:
            expert_weights = expert_weights / (expert_weights.sum(axis=-1, keepdims=True) + 1e-20)
        if "expert_scale" in self:
            expert_weights = expert_weights * self.expert_scale.astype(mx.float32)[expert_indices]
        return expert_indices, expert_weights * self.scale if self.scale != 1.0 else expert_weights


class ExpertLinear(nn.Module):
    """`num_experts` linear maps in one `(num_experts, out, in)` weight (and `(num_experts, out)` bias when
    `bias`); each row uses its expert's."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, expert_indices: mx.array, sorted_indices: bool) -> mx.array:
        y = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=expert_indices, sorted_indices=sorted_indices)
        return with_expert_bias(self, y, expert_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedExpertLinear":
        return QuantizedExpertLinear(self.weight, group_size, bits, mode, self.get("bias"))


def with_expert_bias(module: nn.Module, y: mx.array, expert_indices: mx.array) -> mx.array:
    """y (..., 1, out) plus each row's expert's bias, when `module` has one."""
    return y + mx.expand_dims(module.bias[expert_indices], -2) if "bias" in module else y


class QuantizedExpertLinear(QuantizedWeight):
    """`ExpertLinear` with packed weights: one gathered quantized matmul (`mx.gather_qmm`) for all experts."""

    def __init__(
        self, weight: mx.array, group_size: int, bits: int, mode: str = "affine", bias: mx.array | None = None
    ):
        super().__init__(weight, group_size, bits, mode)
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array, expert_indices: mx.array, sorted_indices: bool) -> mx.array:
        y = mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=expert_indices,
            sorted_indices=sorted_indices,
            **self.quantization(),
        )
        return with_expert_bias(self, y, expert_indices)


def glu(gate: mx.array, up: mx.array, activation: Callable = nn.silu) -> mx.array:
    """activation(gate) * up (a SwiGLU with silu, GeGLU with a GELU)."""
    return activation(gate) * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up."""
    return nn.silu(gate) * up


def clamped_swiglu(gate: mx.array, up: mx.array, alpha: float = 1.702, limit: float = 7.0) -> mx.array:
    """(up + 1) * gate * sigmoid(alpha * gate), with gate clipped to at most `limit` and up to [-limit, limit]:
    a SwiGLU whose sigmoid gain `alpha` makes it GELU-like and whose clamps bound every expert's output."""
    gate, up = mx.minimum(gate, limit), mx.clip(up, -limit, limit)
    return (up + 1) * gate * mx.sigmoid(alpha * gate)


class Experts(nn.Module):
    """The routed experts: down(activation(gate(x), up(x))) with each token's chosen experts' weights.

    `activation` combines the gate and up projections (`swiglu` by default, or `clamped_swiglu`); with
    `bias`, every projection adds its expert's bias.

    For many (token, expert) pairs the pairs are first sorted by expert, so that each expert's
    weights are read once in a row rather than once per token.
    """

    sort_from = 64  # (token, expert) pairs

    def __init__(
        self, dims: int, hidden_dims: int, num_experts: int, bias: bool = False, activation: Callable = swiglu
    ):
        super().__init__()
        self.gate_proj = ExpertLinear(dims, hidden_dims, num_experts, bias)
        self.up_proj = ExpertLinear(dims, hidden_dims, num_experts, bias)
        self.down_proj = ExpertLinear(hidden_dims, dims, num_experts, bias)
        self.activation = activation

    def __call__(self, x: mx.array, expert_indices: mx.array, per_choice: bool = False) -> mx.array:
        """x: (..., dims), expert_indices: (..., k) -> each chosen expert's output (..., k, dims). With `per_choice`,
        x is (..., k, dims): a row of its own for each chosen expert."""
        # one 1-row matrix per token, (..., 1, 1, dims), or per choice, (..., k, 1, dims)
        rows, indices, order = self.grouped(x, expert_indices, per_choice)
        return self.ungrouped(self.project(rows, indices, order is not None), order, expert_indices.shape)

    def grouped(
        self, x: mx.array, expert_indices: mx.array, per_choice: bool = False
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """(rows, their experts, order): one 1-row matrix per token, (..., 1, 1, dims), or per choice, (..., k, 1,
        dims), with the experts each meets; for many pairs, the (token, expert) pairs sorted by expert, flat, and the
        `order` that sorted them (None when unsorted)."""
        rows = mx.expand_dims(x, -2) if per_choice else mx.expand_dims(x, (-2, -3))
        if expert_indices.size < self.sort_from:
            return rows, expert_indices, None
        k = expert_indices.shape[-1]
        order = mx.argsort(expert_indices.flatten())
        rows = rows.flatten(0, -3)[order if per_choice else order // k]
        return rows, expert_indices.flatten()[order], order

    def project(self, rows: mx.array, indices: mx.array, sort: bool) -> mx.array:
        """down(activation(gate(rows), up(rows))), each row by its expert's weights."""
        hidden = self.activation(self.gate_proj(rows, indices, sort), self.up_proj(rows, indices, sort))
        return self.down_proj(hidden, indices, sort)

    @staticmethod
    def ungrouped(out: mx.array, order: mx.array | None, shape: tuple) -> mx.array:
        """The outputs of `grouped`'s rows back in token order, (..., k, dims)."""
        if order is not None:
            out = mx.unflatten(out[mx.argsort(order)], 0, shape)
        return out.squeeze(-2)


class MoE(nn.Module):
    """sum_k weight_k * expert_k(x) over the routed experts, plus the shared experts' SwiGLU if any.

    With `shared_gate` (a dims -> 1 linear map) the shared experts' output is scaled by a per-token
    sigmoid(shared_gate(x)) before it is added. With `weighted_inputs`, each chosen expert reads the token times its
    weight, sum_k expert_k(weight_k * x), instead (Llama 4: not the same, the experts are not linear). With
    `input_norm`, the router reads x and the experts read input_norm(x).
    """

    def __init__(
        self,
        router: Router,
        experts: Experts,
        shared_experts: SwiGLU | None = None,
        shared_gate: nn.Linear | None = None,
        weighted_inputs: bool = False,
        input_norm: nn.Module | None = None,
    ):
        super().__init__()
        self.weighted_inputs = weighted_inputs
        if input_norm is not None:
            self.input_norm = input_norm
        self.router = router
        self.experts = experts
        if shared_experts is not None:
            self.shared_experts = shared_experts
        if shared_gate is not None:
            self.shared_gate = shared_gate
        self.num_experts = router.num_experts
        self.experts_per_token = router.experts_per_token

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert_indices, expert_weights), each (..., experts_per_token), for the tokens of x."""
        return self.router(x)

    def __call__(self, x: mx.array) -> mx.array:
        expert_indices, expert_weights = self.router(x)
        if "input_norm" in self:
            x = self.input_norm(x)
        weights = expert_weights[..., None].astype(x.dtype)
        if self.weighted_inputs:
            out = self.experts(x[..., None, :] * weights, expert_indices, per_choice=True).sum(axis=-2)
        else:
            out = (self.experts(x, expert_indices) * weights).sum(axis=-2)
        if "shared_experts" in self:
            shared = self.shared_experts(x)
            out = out + (mx.sigmoid(self.shared_gate(x)) * shared if "shared_gate" in self else shared)
        return out
