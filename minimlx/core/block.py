"""A transformer block: two sub-layers, each read through a norm and added to the residual stream."""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from .positions import Positions
from .recorder import Recorder


class Block(nn.Module):
    """x + attn(attn_norm(x)), then + ffn(ffn_norm(.)): the pre-norm residual wiring. With `residual_scale`, each
    sub-layer's output is multiplied by it before it is added (Granite's residual multiplier)."""

    def __init__(
        self,
        attn: nn.Module,
        ffn: nn.Module,
        attn_norm: nn.Module,
        ffn_norm: nn.Module,
        residual_scale: float | None = None,
    ):
        super().__init__()
        self.attn_norm, self.attn = attn_norm, attn
        self.ffn_norm, self.ffn = ffn_norm, ffn
        self.residual_scale = residual_scale

    def scaled(self, out: mx.array) -> mx.array:
        return out if self.residual_scale is None else out * self.residual_scale

    def attn_branch(self, x: mx.array, cache=None, recorder: Recorder | None = None, positions=None) -> mx.array:
        return self.attn(self.attn_norm(x), cache, recorder, positions)

    def ffn_input(self, x: mx.array) -> mx.array:
        """What the FFN reads from the residual stream (the routing a trace reports is computed from it)."""
        return self.ffn_norm(x)

    def ffn_branch(self, x: mx.array) -> mx.array:
        return self.ffn(self.ffn_input(x))

    def __call__(
        self, x: mx.array, cache=None, recorder: Recorder | None = None, positions: Positions | None = None
    ) -> mx.array:
        attn_out = self.scaled(self.attn_branch(x, cache, recorder, positions))
        mid = x + attn_out
        mlp_out = self.scaled(self.ffn_branch(mid))
        out = mid + mlp_out
        if recorder is not None:
            recorder(resid_pre=x, attn_out=attn_out, resid_mid=mid, mlp_out=mlp_out, resid_post=out)
        return out


class PostNormBlock(Block):
    """x + attn_norm(attn(x)), then + ffn_norm(ffn(.)): each sub-layer reads the raw residual stream
    and its output is normalised before it is added (the stream itself is never normalised)."""

    def attn_branch(self, x: mx.array, cache=None, recorder: Recorder | None = None, positions=None) -> mx.array:
        return self.attn_norm(self.attn(x, cache, recorder, positions))

    def ffn_input(self, x: mx.array) -> mx.array:
        return x

    def ffn_branch(self, x: mx.array) -> mx.array:
        return self.ffn_norm(self.ffn(x))


class FourNormBlock(Block):
    """x + post_attn_norm(attn(attn_norm(x))), then + post_ffn_norm(ffn(ffn_norm(.))): pre-norm wiring with each
    sub-layer's output normalised again before it is added (Gemma 2 and 3, GLM-4)."""

    def __init__(self, attn, ffn, attn_norm, ffn_norm, post_attn_norm: nn.Module, post_ffn_norm: nn.Module):
        super().__init__(attn, ffn, attn_norm, ffn_norm)
        self.post_attn_norm, self.post_ffn_norm = post_attn_norm, post_ffn_norm

    def attn_branch(self, x: mx.array, cache=None, recorder: Recorder | None = None, positions=None) -> mx.array:
        return self.post_attn_norm(super().attn_branch(x, cache, recorder, positions))

    def ffn_branch(self, x: mx.array) -> mx.array:
        return self.post_ffn_norm(super().ffn_branch(x))


class LayerInputBlock(FourNormBlock):
    """`FourNormBlock` with up to two more inputs, and its output times a learned scalar (`layer_scalar`):

    - `moe`, a mixture of experts beside the dense FFN, routed from the residual stream itself: the FFN sub-layer's
      output is post_ffn_norm(post_dense_norm(ffn(ffn_norm(x))) + post_moe_norm(moe(x)));
    - `input_dims`, the layer's own input (`Positions.layer_input`, from `PerLayerInputs`): after both sub-layers,
      + input_norm(input_proj(activation(input_gate(h)) * input)).
    """

    def __init__(
        self,
        attn,
        ffn,
        norms: list[nn.Module],
        layer: int,
        dims: int,
        moe: nn.Module | None = None,
        input_dims: int = 0,
        activation: Callable | None = None,
    ):
        attn_norm, ffn_norm, post_attn_norm, post_ffn_norm, *more = norms
        super().__init__(attn, ffn, attn_norm, ffn_norm, post_attn_norm, post_ffn_norm)
        self.layer, self.activation = layer, activation
        if moe is not None:
            self.moe = moe
            self.post_dense_norm, self.post_moe_norm = more[:2]
        if input_dims:
            self.input_norm = more[-1]
            self.input_gate = nn.Linear(dims, input_dims, bias=False)
            self.input_proj = nn.Linear(input_dims, dims, bias=False)
        self.input_dims = input_dims
        self.layer_scalar = mx.ones((1,))

    def ffn_branch(self, x: mx.array) -> mx.array:
        if "moe" not in self:
            return super().ffn_branch(x)
        dense = self.post_dense_norm(self.ffn(self.ffn_input(x)))
        return self.post_ffn_norm(dense + self.post_moe_norm(self.moe(x)))

    def __call__(
        self, x: mx.array, cache=None, recorder: Recorder | None = None, positions: Positions | None = None
    ) -> mx.array:
        h = super().__call__(x, cache, recorder, positions)
        if self.input_dims:
            own = self.activation(self.input_gate(h)) * positions.layer_input(self.layer)
            h = h + self.input_norm(self.input_proj(own))
        return h * self.layer_scalar.astype(h.dtype)
