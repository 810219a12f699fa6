"""What an adapter changes, block by block: the base model and the adapted one traced on the same prompt.

For each block, what its attention and its FFN add to the residual stream (the norms of `attn_out` and `mlp_out`)
in the base and in the adapted model, and how far the stream leaving it has moved (the norm of the difference of
the two `resid_post`, relative to the base's), at each of the prompt's positions (`block_changes`, what the
explainer shows at the position picked) or averaged over them (`adapter_effect`); then the next token each model
predicts. The base is the adapted model with its adapters detached (`minimlx.tune.detached`): one copy of the
weights. A block before the first adapted one adds exactly what the base's adds.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..tune.lora import detached
from .ablation import Ablation
from .trace import trace

CHANGES = ("attn_before", "attn_after", "mlp_before", "mlp_after", "shift")


def compared_names(model: nn.Module) -> list[str]:
    """The activations `block_changes` reads, and the logits."""
    blocks = [f"layers.{i}.{what}" for i in range(len(model.layers)) for what in ("attn_out", "mlp_out", "resid_post")]
    return [*blocks, "logits"]


def base_trace(model: nn.Module, ids, ablate: Ablation | None = None, images=None) -> dict[str, mx.array]:
    """The trace of the adapted `model`'s base on `ids` (under `ablate`, with `images` placed as `trace` places them):
    what `block_changes` compares against."""
    with detached(model):
        return trace(model, ids, compared_names(model), ablate=ablate, images=images)


def norms(x: mx.array) -> mx.array:
    return mx.linalg.norm(x[0].astype(mx.float32), axis=-1)


def block_changes(before: dict[str, mx.array], after: dict[str, mx.array], layers: int) -> list[dict[str, mx.array]]:
    """Per block, from the traces of one prompt through the base (`before`) and the adapted model (`after`): each of
    `CHANGES` at every position (tokens,)."""
    blocks = []
    for i in range(layers):
        attn, mlp, stream = (f"layers.{i}.{what}" for what in ("attn_out", "mlp_out", "resid_post"))
        moved = norms(after[stream] - before[stream]) / norms(before[stream])
        values = (norms(before[attn]), norms(after[attn]), norms(before[mlp]), norms(after[mlp]), moved)
        blocks.append(dict(zip(CHANGES, values)))
    return blocks


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


def adapter_effect(model: nn.Module, ids) -> AdapterEffect:
    """Trace `model` (loaded with an adapter, or with one attached) with and without its adapters on the token ids
    `ids` of one prompt."""
    before, after = base_trace(model, ids), trace(model, ids, compared_names(model))
    changes = block_changes(before, after, len(model.layers))
    blocks = [BlockChange(i, *(block[k].mean().item() for k in CHANGES)) for i, block in enumerate(changes)]
    top = [int(mx.argmax(v["logits"][0, -1]).item()) for v in (before, after)]
    return AdapterEffect(blocks, *top)
