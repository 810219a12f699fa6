"""Attention patterns: which earlier tokens each token reads, in one layer, per head or over all heads.

Row t of a pattern is how token t shares its attention among itself and the tokens before it (the
softmax of its query against their keys): the seed's "share of attention each earlier token gets".
The weights come from `trace(..., attention=True)`; each row sums to 1, or to 1 minus the sink's
share in layers with attention sinks.
"""

from dataclasses import asdict, dataclass

import mlx.nn as nn

from ..errors import InvalidSettingError
from .trace import attention_layers, trace


@dataclass
class AttentionPattern:
    """`weights[t][s]`: the share of token t's attention on token s (0 for s after t), for query head `head`,
    or the mean over the layer's `heads` when `head` is None."""

    tokens: list[str]
    layer: int
    head: int | None
    heads: int
    weights: list[list[float]]

    def to_dict(self) -> dict:
        return asdict(self)


def attention_pattern(
    model: nn.Module, tokenizer, prompt: str, layer: int | None = None, head: int | None = None
) -> AttentionPattern:
    """The attention pattern of `prompt` (encoded as is, no chat template) in `layer` (default the last that attends),
    for query head `head` (default the mean over all heads)."""
    layers, attending = len(model.layers), attention_layers(model)
    if not attending:
        raise InvalidSettingError("this model has no attention layer (every token-mixer is recurrent): no pattern")
    layer = attending[-1] if layer is None else layer
    if not 0 <= layer < layers:
        raise InvalidSettingError(
            f"layer must be between 0 and {layers - 1} (the model has {layers} layers), got {layer}"
        )
    if layer not in attending:
        raise InvalidSettingError(
            f"layer {layer} is a recurrent layer: it has no attention pattern; pick one of the attention layers "
            f"{attending}"
        )
    heads = model.layers[layer].attn.heads
    if head is not None and not 0 <= head < heads:
        raise InvalidSettingError(
            f"head must be between 0 and {heads - 1} (layer {layer} has {heads} query heads), got {head}"
        )
    ids = tokenizer.encode(prompt)
    name = f"layers.{layer}.attn_weights"
    weights = trace(model, ids, [name])[name][0]  # (heads, tokens, tokens)
    pattern = weights.mean(axis=0) if head is None else weights[head]
    return AttentionPattern([tokenizer.decode([i]) for i in ids], layer, head, heads, pattern.tolist())
