"""Speculative decoding: guess several tokens cheaply, check them all in one forward pass of the model.

Decoding on the CPU is bound by reading the weights once per forward pass, and a pass over k + 1
tokens reads them once too. So each round a drafter proposes up to k tokens, the model scores
the last token and the k drafts together, and every draft it agrees with is a token gained; the
first disagreement is replaced by the model's own token and the cache is trimmed back to it (`Rollback`: a
cache that cannot be cut back there is restored from a snapshot taken before the pass and fed the kept tokens).
The engine runs the rounds (`Engine.speculate`); this module holds the drafters and the verifier.

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

import mlx.core as mx
import mlx.nn as nn

from ..core.cache import Cache, Can
from ..core.sampling import filtered_logits
from ..core.steps import decode_steps
from ..errors import InvalidSettingError
from .prefill import marked, prefill, reusable, shared_start
from .settings import SamplingSettings, check_whole


def check_speculation(drafters: int, settings: SamplingSettings | None = None) -> None:
    """Refuse what speculative decoding cannot do, before any work: more than one of the `drafters` asked for, or
    drafting with a repetition penalty in `settings`."""
    if drafters > 1:
        raise InvalidSettingError("choose one drafter: a draft model or prompt lookup, not both")
    if drafters and settings is not None and settings.repetition_penalty != 1.0:
        raise InvalidSettingError("speculative decoding does not apply a repetition penalty; drop one of them")


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
        shared = reusable(self.cache, shared_start(self.read, context))  # a window may have dropped what it needs
        if shared == 0:
            self.reset()
        for c in self.cache:
            c.trim(c.offset - shared)
        prefill(self.model, context[shared:-1], self.cache, self.prefill_step)
        mx.eval([c.state for c in self.cache])
        feed, drafts, rows = mx.array([context[-1:]]), [], []
        for _ in range(count):  # queued lazily, evaluated once
            with decode_steps():
                logits = self.model(feed, marked(self.cache))[:, -1]
            q = verifier.probabilities(logits)
            feed = mx.random.categorical(mx.log(q), key=verifier.next_key())[:, None]
            drafts.append(feed)
            rows.append(q)
        drafts = mx.concatenate(drafts, axis=1)[0]
        rows = mx.concatenate(rows)
        mx.eval(drafts, rows)
        self.read = context + drafts.tolist()[:-1]
        return drafts.tolist(), rows


class Rollback:
    """Takes a round's rejected drafts back out of the model's cache. Per-token entries that nothing drops are trimmed;
    other kinds (a window, which may have dropped the tokens trimming would go back to; a recurrent state, which
    cannot be cut) get a snapshot before the pass, restored afterwards (the others trimmed back as far) and fed the
    tokens kept."""

    def __init__(self, cache: list[Cache]):
        self.cache = cache
        self.snapshots = [None if cuts(c) else c.snapshot() for c in cache]

    def keep(self, model: nn.Module, kept: list[int], rejected: int) -> None:
        """Forget the last `rejected` tokens the pass fed, `kept` being those it fed before them."""
        if all(c.keeps(c.offset - rejected) for c in self.cache):
            for c in self.cache:
                c.trim(rejected)
            return
        for c, snapshot in zip(self.cache, self.snapshots):
            if snapshot is None:
                c.trim(len(kept) + rejected)
            else:
                c.restore(snapshot)
        with decode_steps():
            model(mx.array([kept]), self.cache)
        mx.eval([c.state for c in self.cache])


def cuts(cache: Cache) -> bool:
    """Whether `cache` goes back to any earlier count by `trim` alone (per-token entries that nothing drops)."""
    return cache.can(Can.CUT) and not cache.can(Can.WINDOW)


class Verifier:
    """The model's side of a round: its distributions over the drafted positions, and the accept/reject rule.

    At temperature 0 the distribution is one-hot on the argmax (drafts kept while they equal it); otherwise the
    logits go through the sampler's filters (`filtered_logits`). `key` starts the chain of keys its draws take.
    """

    def __init__(self, settings: SamplingSettings, key: mx.array | None = None):
        self.settings, self.key = settings, key

    def probabilities(self, logits: mx.array) -> mx.array:
        """(rows, vocab) logits -> (rows, vocab) probabilities of the token that would be sampled."""
        s = self.settings
        if s.temperature == 0:
            best = mx.argmax(logits, axis=-1, keepdims=True)
            return (mx.arange(logits.shape[-1]) == best).astype(mx.float32)
        return mx.softmax(filtered_logits(logits, s.temperature, s.top_p, s.top_k, s.min_p), axis=-1)

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def verify(self, logits: mx.array, drafts: list[int], q: mx.array | None) -> tuple[int, int]:
        """(drafts accepted, the token after them) from the model's logits (k + 1, vocab) over the last
        token and the k drafts; `q` (k, vocab) is the drafter's distribution, None when its drafts are certain."""
        if self.settings.temperature == 0:
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
