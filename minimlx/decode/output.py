"""What a generation hands back per token: its text (detokenized, held back where a stop string may start), its
logprobs when asked for, and the `Output` event that carries them."""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..core.sampling import token_logprobs


@dataclass
class Output:
    """One token of one generation, the text it completes (possibly ""), and why the generation ended, if it did."""

    generation: "Generation"  # noqa: F821 (minimlx.decode.generation)
    token: int
    text: str
    # "stop" (an end id, a stop string, a complete grammar), "length", "error" (`Generation.failure` says what
    # failed: this sequence's own sampling, grammar or text, while the rest of the batch goes on), None while it goes on
    finish_reason: str | None
    logprob: float | None = None  # asked for by `logprobs`: the token's log-probability under the model
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (id, logprob) of the most likely tokens, best first


def split_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str, str | None]:
    """(text safe to emit, text held back because a stop string may start there, the stop string that ended it)."""
    found = [(i, s) for i, s in ((text.find(s), s) for s in stop) if i >= 0]
    if found:
        at, string = min(found)
        return text[:at], "", string
    held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held], text[len(text) - held :], None


class TextStream:
    """A generation's text: tokens detokenized (none without a tokenizer), cut at the first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.detokenizer = tokenizer.detokenizer() if tokenizer is not None else None
        self.stop = stop
        self.held = ""  # text that may be the start of a stop string
        self.stop_string: str | None = None  # the stop string that ended it, if one did

    def add(self, token: int, end: bool, finish: str | None) -> str:
        """The text `token` completes, safe to emit; `end`: the token is an end id (not text); `finish`: why the
        generation ends with it, if it does (then the detokenizer's and the held text come out)."""
        text = ""
        if self.detokenizer is not None:
            text = self.held + ("" if end else self.detokenizer.add(token))
            if finish is not None:
                text += self.detokenizer.finalize()
        text, self.held, self.stop_string = split_at_stop(text, self.stop) if self.stop else (text, "", None)
        if finish is not None and self.stop_string is None:
            text += self.held
        return text


class Logprobs:
    """The logprobs asked for (`asked` alternatives with each token), queued lazily until the token is read."""

    def __init__(self, asked: int):
        self.asked = asked
        self.pending: deque[tuple[mx.array, ...]] = deque()  # of tokens not read yet, lazy

    def note(self, logits: mx.array, tokens: mx.array) -> None:
        """Queue the logprobs of `tokens` (n,) under the model's own `logits` (n, vocab)."""
        chosen, ids, values = token_logprobs(logits, tokens, self.asked)
        self.pending.extend((chosen[i], ids[i], values[i]) for i in range(tokens.size))

    def read(self) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(the next token's logprob, its top alternatives)."""
        chosen, ids, values = self.pending.popleft()
        return chosen.item(), tuple(zip(ids.tolist(), values.tolist()))
