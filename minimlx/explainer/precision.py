"""Two precisions of one model side by side: how far the packed model's residual stream drifts from float32's."""

import mlx.core as mx
import mlx.nn as nn

from ..anatomy.lens import top_guesses
from ..anatomy.similarity import cosine
from ..anatomy.trace import residual_stream


def precision_drift(first: nn.Module, second: nn.Module, tokenizer, ids: list[int]) -> dict:
    """Per row of the stream (embedding, then each block): the cosine between the two models' states and the
    norm of their difference relative to the first's, each per position; and each model's top lens token."""
    a, b = residual_stream(first, ids).astype(mx.float32), residual_stream(second, ids).astype(mx.float32)
    relative = mx.linalg.norm(a - b, axis=-1) / mx.linalg.norm(a, axis=-1)
    tops = [top_guesses(model, stream, 1) for model, stream in ((first, a), (second, b))]
    return {
        "tokens": [tokenizer.decode([i]) for i in ids],
        "layers": ["embed"] + [str(i) for i in range(len(first.layers))],
        "cosine": cosine(a, b).tolist(),
        "relative_difference": relative.tolist(),
        "top": [[[tokenizer.decode([r[0]]) for r in row] for row in top_ids] for top_ids, _ in tops],
    }
