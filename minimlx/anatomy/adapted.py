"""What an adapter changes, block by block: the base model and the adapted one traced on the same prompt.

For each block, what its attention and its FFN add to the residual stream (the norms of `attn_out` and `mlp_out`)
in the base and in the adapted model, and how far the stream leaving it has moved (the norm of the difference of
the two `resid_post`, relative to the base's), averaged over the prompt's positions; then the next token each
model predicts. A block before the first adapted one adds exactly what the base's adds.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidSettingError
from .trace import trace


@dataclass
class BlockChange:
    """One block: what attention and the FFN add (mean norm over positions) before and after the adapter, and the
    stream's relative move (`shift`)."""

    layer: int
    attn_before: float
    attn_after: float
    mlp_before: float
    mlp_after: float
    shift: float


@dataclass
class AdapterEffect:
    blocks: list[BlockChange]
    next_before: int  # the base's top next token after the prompt
    next_after: int  # the adapted model's

    def to_dict(self) -> dict:
        blocks = [vars(b) for b in self.blocks]
        return {"blocks": blocks, "next_token_before": self.next_before, "next_token_after": self.next_after}


def mean_norm(x: mx.array) -> float:
    return mx.linalg.norm(x[0].astype(mx.float32), axis=-1).mean().item()


def adapter_effect(base: nn.Module, adapted: nn.Module, ids) -> AdapterEffect:
    """Trace `base` and `adapted` (the same model with an adapter applied) on the token ids `ids` of one prompt."""
    if len(base.layers) != len(adapted.layers):
        raise InvalidSettingError("the adapted model has another number of blocks than the base; give the same model")
    names = [f"layers.{i}.{what}" for i in range(len(base.layers)) for what in ("attn_out", "mlp_out", "resid_post")]
    before, after = trace(base, ids, [*names, "logits"]), trace(adapted, ids, [*names, "logits"])
    blocks = []
    for i in range(len(base.layers)):
        stream = f"layers.{i}.resid_post"
        moved = mx.linalg.norm((after[stream] - before[stream])[0].astype(mx.float32), axis=-1)
        shift = (moved / mx.linalg.norm(before[stream][0].astype(mx.float32), axis=-1)).mean().item()
        attn, mlp = f"layers.{i}.attn_out", f"layers.{i}.mlp_out"
        blocks.append(
            BlockChange(
                i, mean_norm(before[attn]), mean_norm(after[attn]), mean_norm(before[mlp]), mean_norm(after[mlp]), shift
            )
        )
    top = [int(mx.argmax(v["logits"][0, -1]).item()) for v in (before, after)]
    return AdapterEffect(blocks, *top)
