"""The logit lens: read the residual stream after every block as if it were the last one.

The model's own last step (final norm, then lm_head, then softmax) is applied to the stream
after the embedding and after each block. Early rows predict little that makes sense; the last
row is exactly the model's output distribution (nostalgebraist, "interpreting GPT: the logit lens").
"""

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidSettingError
from .trace import residual_stream


@dataclass
class LensResult:
    """Top-k next-token guesses per row (`embed`, then each block) and prompt position."""

    tokens: list[str]
    layers: list[str]
    top_tokens: list[list[list[str]]]  # [row][position][rank]
    top_ids: list[list[list[int]]]
    top_probs: list[list[list[float]]]

    def to_dict(self) -> dict:
        return asdict(self)


def unembed(model: nn.Module, hidden: mx.array) -> mx.array:
    """The model's last step on any hidden state: final norm, then the lm_head (or the tied embedding)."""
    return model.unembed(model.norm(hidden))


def layer_distributions(model: nn.Module, ids) -> mx.array:
    """Next-token probabilities read after the embedding and after each block: (layers + 1, tokens, vocab)."""
    logits = unembed(model, residual_stream(model, ids))
    return mx.softmax(logits.astype(mx.float32), axis=-1)


def logit_lens(model: nn.Module, tokenizer, prompt: str, top_k: int = 5) -> LensResult:
    """The logit lens of `prompt` (encoded as is, no chat template): top_k tokens per row and position."""
    ids = tokenizer.encode(prompt)
    probs = layer_distributions(model, ids)
    if not 1 <= top_k <= probs.shape[-1]:
        raise InvalidSettingError(f"top_k must be between 1 and the vocabulary size {probs.shape[-1]}, got {top_k}")
    top_ids = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k]
    top_probs = mx.take_along_axis(probs, top_ids, axis=-1)
    order = mx.argsort(-top_probs, axis=-1)
    top_ids = mx.take_along_axis(top_ids, order, axis=-1).tolist()
    top_probs = mx.take_along_axis(top_probs, order, axis=-1).tolist()
    return LensResult(
        tokens=[tokenizer.decode([i]) for i in ids],
        layers=["embed"] + [str(i) for i in range(len(model.layers))],
        top_tokens=[[[tokenizer.decode([i]) for i in ranks] for ranks in row] for row in top_ids],
        top_ids=top_ids,
        top_probs=top_probs,
    )
