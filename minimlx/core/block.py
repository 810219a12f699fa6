"""A transformer block: two sub-layers, each read through a norm and added to the residual stream."""

import mlx.core as mx
import mlx.nn as nn

from .recorder import Recorder


class Block(nn.Module):
    """x + attn(attn_norm(x)), then + ffn(ffn_norm(.)): the pre-norm residual wiring."""

    def __init__(self, attn: nn.Module, ffn: nn.Module, attn_norm: nn.Module, ffn_norm: nn.Module):
        super().__init__()
        self.attn_norm, self.attn = attn_norm, attn
        self.ffn_norm, self.ffn = ffn_norm, ffn

    def __call__(self, x: mx.array, cache=None, recorder: Recorder | None = None) -> mx.array:
        attn_out = self.attn(self.attn_norm(x), cache)
        mid = x + attn_out
        mlp_out = self.ffn(self.ffn_norm(mid))
        out = mid + mlp_out
        if recorder is not None:
            recorder(resid_pre=x, attn_out=attn_out, resid_mid=mid, mlp_out=mlp_out, resid_post=out)
        return out
