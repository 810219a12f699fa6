"""Speculative decoding: guess several tokens cheaply, check them all in one forward pass of the model.

Decoding on the CPU is bound by reading the weights once per forward pass, and a pass over k + 1
tokens reads them once too. So each round a drafter proposes up to k tokens, the model scores
the last token and the k drafts together, and every draft it agrees with is a token gained; the
first disagreement is replaced by the model's own token and the cache is trimmed back to it.

Two drafters:
- `PromptLookup`: the tokens that followed the latest earlier occurrence of the text's last
  n-gram (in the prompt or the answer so far). No second model; it pays off where the answer
  copies its input (rewriting, editing, summarising with quotes, code changes).
- `DraftModel`: a small model sharing the tokenizer, decoding k tokens ahead.

Greedy decoding accepts a draft while it equals the model's argmax, so the tokens are those of
plain decoding. Sampling uses the accept/reject rule of Leviathan et al. (2023): draft x, drawn
with probability q(x), is kept with probability min(1, p(x) / q(x)) where p is the model's
(filtered) distribution; at the first rejection the token is drawn from max(p - q, 0)
renormalised; when every draft is kept, one more token is drawn from p. Each emitted token is
then distributed exactly as p. Prompt lookup's drafts are certain (q is one-hot).
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .checks import check_whole, vocab_size
from .core.sampling import filtered_logits
from .errors import InvalidSettingError


@dataclass
class Acceptance:
    """How many tokens the drafter proposed and how many of them the model kept."""

    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class PromptLookup:
    """Drafts by copying: find the last `max_ngram` (then fewer, down to one) tokens earlier in the text,
    and propose the `tokens` that followed their latest occurrence."""

    def __init__(self, tokens: int, max_ngram: int = 3):
        check_whole("prompt_lookup", tokens, 1)
        self.tokens, self.max_ngram = tokens, max_ngram

    def draft(self, context: list[int], count: int, verifier: "Verifier") -> tuple[list[int], None]:
        """(up to `count` drafted tokens, None: each is certain)."""
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + count], None
        return [], None

    def reset(self) -> None:
        """Nothing is kept between sequences."""


class DraftModel:
    """Drafts by decoding `tokens` ahead with a smaller model that shares the tokenizer.

    Its cache follows the text: before each round it keeps the tokens it shares with the text
    and reads the rest (the whole prompt, the first time).
    """

    def __init__(self, model: nn.Module, tokens: int, prefill_step: int = 512):
        check_whole("draft tokens", tokens, 1)
        self.model, self.tokens, self.prefill_step = model, tokens, prefill_step
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.make_cache()
        self.read: list[int] = []  # the tokens in the cache

    def draft(self, context: list[int], count: int, verifier: "Verifier") -> tuple[list[int], mx.array]:
        """(`count` drafted tokens, the distributions (count, vocab) they were drawn from, filtered as the
        verifier filters the model's)."""
        shared = 0
        limit = min(len(self.read), len(context) - 1)
        while shared < limit and self.read[shared] == context[shared]:
            shared += 1
        for c in self.cache:
            c.trim(c.offset - shared)
        ids = mx.array(context[shared:])[None]
        for start in range(0, ids.shape[1] - 1, self.prefill_step):
            self.model(ids[:, start : min(start + self.prefill_step, ids.shape[1] - 1)], self.cache)
            mx.eval([c.state for c in self.cache])
        feed, drafts, rows = ids[:, -1:], [], []
        for _ in range(count):  # queued lazily, evaluated once
            q = verifier.probabilities(self.model(feed, self.cache)[:, -1])
            feed = mx.random.categorical(mx.log(q), key=verifier.next_key())[:, None]
            drafts.append(feed)
            rows.append(q)
        drafts = mx.concatenate(drafts, axis=1)[0]
        rows = mx.concatenate(rows)
        mx.eval(drafts, rows)
        self.read = context + drafts.tolist()[:-1]
        return drafts.tolist(), rows


class Verifier:
    """The model's side of a round: its distributions over the drafted positions, and the accept/reject rule.

    At temperature 0 the distribution is one-hot on the argmax (drafts kept while they equal it);
    otherwise the logits go through the sampler's filters (`filtered_logits`).
    """

    def __init__(self, temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None):
        self.temperature, self.top_p, self.top_k, self.min_p = temperature, top_p, top_k, min_p
        self.key = mx.random.key(seed) if seed is not None else None

    def probabilities(self, logits: mx.array) -> mx.array:
        """(rows, vocab) logits -> (rows, vocab) probabilities of the token that would be sampled."""
        if self.temperature == 0:
            best = mx.argmax(logits, axis=-1, keepdims=True)
            return (mx.arange(logits.shape[-1]) == best).astype(mx.float32)
        return mx.softmax(filtered_logits(logits, self.temperature, self.top_p, self.top_k, self.min_p), axis=-1)

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def verify(self, logits: mx.array, drafts: list[int], q: mx.array | None) -> tuple[int, int]:
        """(drafts accepted, the token after them) from the model's logits (k + 1, vocab) over the last
        token and the k drafts; `q` (k, vocab) is the drafter's distribution, None when its drafts are certain."""
        if self.temperature == 0:
            best = mx.argmax(logits, axis=-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == best[accepted]:
                accepted += 1
            return accepted, best[accepted]
        p, k = self.probabilities(logits), len(drafts)
        uniform_key, token_key = mx.random.split(key) if (key := self.next_key()) is not None else (None, None)
        accepted = k
        if k:
            rows, ids = mx.arange(k), mx.array(drafts)
            q_drafted = q[rows, ids] if q is not None else 1.0
            keep = (mx.random.uniform(shape=(k,), key=uniform_key) * q_drafted < p[rows, ids]).tolist()
            accepted = keep.index(False) if False in keep else k
        if accepted < k:
            drafted = q[accepted] if q is not None else mx.arange(p.shape[-1]) == drafts[accepted]
            residual = mx.maximum(p[accepted] - drafted, 0)
        else:
            residual = p[k]
        return accepted, mx.random.categorical(mx.log(residual), key=token_key).item()


def speculative_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    cache: list,
    drafter: PromptLookup | DraftModel,
    verifier: Verifier,
    max_tokens: int,
    acceptance: Acceptance,
    prefill_step: int = 512,
) -> Iterator[int]:
    """Yield up to `max_tokens` token ids continuing `prompt` (which continues `cache`), a round of
    accepted drafts and one token of the model's at a time; `acceptance` counts the drafts as it goes.

    The cache holds every token of the text but the last; a round reads that one and the drafts.
    """
    if isinstance(drafter, DraftModel) and vocab_size(drafter.model) != vocab_size(model):
        raise InvalidSettingError(
            f"the draft model's vocabulary ({vocab_size(drafter.model)} tokens) differs from the model's "
            f"({vocab_size(model)}); the draft model must share the model's tokenizer"
        )
    context = list(prompt)
    ids = mx.array(context[:-1], dtype=mx.int32)
    for start in range(0, ids.size, prefill_step):
        model(ids[None, start : start + prefill_step], cache)
        mx.eval([c.state for c in cache])
    produced = 0
    while produced < max_tokens:
        count = min(drafter.tokens, max_tokens - produced - 1)  # the round's own token comes on top
        drafts, q = drafter.draft(context, count, verifier) if count else ([], None)
        logits = model(mx.array([context[-1:] + drafts]), cache)[0]
        accepted, token = verifier.verify(logits, drafts, q)
        for c in cache:
            c.trim(len(drafts) - accepted)
        acceptance.drafted += len(drafts)
        acceptance.accepted += accepted
        new = drafts[:accepted] + [token]
        context += new
        produced += len(new)
        yield from new
