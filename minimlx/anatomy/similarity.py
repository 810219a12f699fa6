"""How far the residual stream moves: cosine similarities across layers and contexts.

Every block only adds to the stream, so a token's hidden state stays close to the embedding it
started from; the same word in two sentences starts identical and drifts apart layer by layer
as attention mixes in each context (the "bank" experiment).
"""

import re
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidSettingError
from .trace import residual_stream


def cosine(a: mx.array, b: mx.array) -> mx.array:
    """Cosine similarity along the last axis, in float32."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))


def embedding_similarity(model: nn.Module, ids) -> mx.array:
    """Cosine of each token's hidden state to its embedding, per row of the residual stream: (layers + 1, tokens)."""
    stream = residual_stream(model, ids)
    return cosine(stream, stream[0])


def word_position(tokenizer, ids: list[int], sentence: str, word: str) -> int:
    """Index of the last token of the first whole-word occurrence of `word` in `sentence` (tokenized as `ids`)."""
    found = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", sentence)
    if found is None:
        raise InvalidSettingError(
            f"the word {word!r} does not occur in {sentence!r}; pick a word both sentences contain"
        )
    for i in range(len(ids)):
        if len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True)) >= found.end():
            return i
    raise InvalidSettingError(f"cannot find the tokens of {word!r} in {sentence!r}; pick a word both sentences contain")


@dataclass
class WordComparison:
    """The word's token in each sentence and the cosine between its two hidden states per row."""

    word: str
    tokens: tuple[str, str]
    positions: tuple[int, int]
    layers: list[str]
    similarity: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def compare_word(model: nn.Module, tokenizer, first: str, second: str, word: str) -> WordComparison:
    """Per-layer cosine similarity of `word`'s hidden state in sentence `first` and in sentence `second`."""
    states, tokens, positions = [], [], []
    for sentence in (first, second):
        ids = tokenizer.encode(sentence)
        position = word_position(tokenizer, ids, sentence, word)
        states.append(residual_stream(model, ids)[:, position])
        tokens.append(tokenizer.decode([ids[position]]))
        positions.append(position)
    return WordComparison(
        word=word,
        tokens=tuple(tokens),
        positions=tuple(positions),
        layers=["embed"] + [str(i) for i in range(len(model.layers))],
        similarity=cosine(*states).tolist(),
    )
