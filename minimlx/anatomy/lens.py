"""The logit lens: read the residual stream after every block as if it were the last one.

The model's own last step (final norm, then lm_head, then softmax) is applied to the stream
after the embedding and after each block. Early rows predict little that makes sense; the last
row is exactly the model's output distribution (nostalgebraist, "interpreting GPT: the logit lens").
"""

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidSettingError
from .ablation import Ablation
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


def layer_distributions(model: nn.Module, ids, ablate: Ablation | None = None) -> mx.array:
    """Next-token probabilities read after the embedding and after each block: (layers + 1, tokens, vocab)."""
    logits = unembed(model, residual_stream(model, ids, ablate))
    return mx.softmax(logits.astype(mx.float32), axis=-1)


def top_guesses(model: nn.Module, stream: mx.array, top_k: int, positions_at_once: int = 2048) -> tuple[list, list]:
    """(ids, probabilities) of the top_k tokens read from each row of `stream` (rows, tokens, dims), most likely
    first. A few rows at a time (`positions_at_once` positions), so that memory holds that many distributions,
    not one per layer; each probability is exp(logit - logsumexp), without forming the whole softmax."""
    rows_at_once = max(1, positions_at_once // stream.shape[1])
    ids, probs = [], []
    for start in range(0, stream.shape[0], rows_at_once):
        logits = unembed(model, stream[start : start + rows_at_once]).astype(mx.float32)
        if not 1 <= top_k <= logits.shape[-1]:
            raise InvalidSettingError(
                f"top_k must be between 1 and the vocabulary size {logits.shape[-1]}, got {top_k}"
            )
        top = mx.argpartition(logits, kth=-top_k, axis=-1)[..., -top_k:]
        top_logits = mx.take_along_axis(logits, top, axis=-1)
        order = mx.argsort(-top_logits, axis=-1)
        top_probs = mx.exp(
            mx.take_along_axis(top_logits, order, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
        )
        ids += mx.take_along_axis(top, order, axis=-1).tolist()
        probs += top_probs.tolist()
    return ids, probs


def logit_lens(model: nn.Module, tokenizer, prompt: str, top_k: int = 5, ablate: Ablation | None = None) -> LensResult:
    """The logit lens of `prompt` (encoded as is, no chat template): top_k tokens per row and position, with
    `ablate`'s interventions applied (see `minimlx.anatomy.ablation`)."""
    ids = tokenizer.encode(prompt)
    top_ids, top_probs = top_guesses(model, residual_stream(model, ids, ablate), top_k)
    return LensResult(
        tokens=[tokenizer.decode([i]) for i in ids],
        layers=["embed"] + [str(i) for i in range(len(model.layers))],
        top_tokens=[[[tokenizer.decode([i]) for i in ranks] for ranks in row] for row in top_ids],
        top_ids=top_ids,
        top_probs=top_probs,
    )
