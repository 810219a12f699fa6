"""Running a step's plan on the model: prefills (alone, together, a chunk), the batched decode step, picking each
row's token (its sampling, its grammar's mask, its logprobs) and speculative rounds; and handing a finished
sequence's cache to whoever keeps it."""

import contextlib
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.sampling import greedy
from ..core.steps import decode_steps, prompt_steps
from .adapters import Adapters
from .generation import Generation
from .images import EncodedImages
from .output import Output
from .prefill import marked, prefill, prefill_prompt
from .prompt_cache import PromptCache
from .scheduler import Chunk, Prefill
from .speculative import Rollback, Verifier


class SharedSteps:
    """What a model split across processes declares (`minimlx.distributed.Distributed`): each engine step runs under
    its `step_guard`, and its sampled tokens pass through `agree`, which gives every process the same. A model
    that is not one gets these, which do nothing."""

    def step_guard(self):
        return contextlib.nullcontext()

    def agree(self, tokens: mx.array) -> mx.array:
        return tokens


@dataclass
class Batch:
    """The sequences decoding together: one per row, in row order, with one batch cache per layer, the last sampled
    token of each row (rows,), and whether those are still to be read back (not when they are first tokens)."""

    rows: list[Generation]
    cache: list | None = None
    tokens: mx.array | None = None
    unread: bool = False


Prefilled = tuple[list[Generation], list, mx.array]  # (generations, their cache (a row each), their first tokens)


class Runner:
    """Executes what the scheduler planned on `decoder` (`model`, or its compiled step), feeding prompts
    `prefill_step` tokens a pass (a prompt's images through `model`); with a `drafter`, decodes in speculative rounds;
    with `adapters`, each pass runs every row with its request's adapter. `batch_sizes` counts the decode steps by how
    many rows they ran."""

    def __init__(
        self,
        decoder: nn.Module,
        prefill_step: int,
        drafter,
        shared: SharedSteps,
        prompt_cache,
        adapters=None,
        model: nn.Module | None = None,
        encoded_images: EncodedImages | None = None,
    ):
        self.decoder, self.prefill_step, self.drafter, self.shared = decoder, prefill_step, drafter, shared
        self.model = decoder if model is None else model  # what reads a prompt's images (the decoder's model)
        self.encoded_images = EncodedImages() if encoded_images is None else encoded_images
        self.prompt_cache: PromptCache | None = prompt_cache
        self.adapters: Adapters | None = adapters
        self.biases: tuple[list[Generation], mx.array] | None = None  # `row_biases`: the rows and their biases
        self.batch_sizes: Counter[int] = Counter()

    @contextlib.contextmanager
    def adapted(self, rows: list[Generation]):
        """The passes queued inside run `rows` (in row order), each with its request's adapter; any other pass of
        the model (an embedding, a trace) runs on the base."""
        if self.adapters is None:
            yield
            return
        self.adapters.select([s.request.adapter for s in rows])
        try:
            yield
        finally:
            self.adapters.select([])

    def prefill(self, plan: Prefill) -> Prefilled:
        """Joiners prefill together in one pass (`prefill_together`), a lone one alone. Even a joiner that needs one
        prompt token (the prompt cache or its conversation holds the rest) gets a prefill of its own rather than a
        row of the next decode step: its first token then comes from the same kind of pass as when its prompt is fed
        whole, sampled from the prompt's last position."""
        if len(plan.members) > 1:
            return self.prefill_together(plan.members)
        return self.prefill_alone(*plan.members[0], plan.start)

    def feed(self, chunk: Chunk) -> None:
        """Feed one chunk of a long prompt into its cache, evaluated (its pass runs between the batch's steps)."""
        prompt = chunk.sequence.request.prompt
        with self.adapted([chunk.sequence]):
            prefill(self.decoder, prompt[chunk.start : chunk.start + chunk.count], chunk.cache, self.prefill_step)
        mx.eval([c.state for c in chunk.cache])

    def prefill_alone(self, generation: Generation, cache: list, fed: int | None = None) -> Prefilled:
        """Feed the prompt from token `fed` (its cached tokens by default) and sample the first token."""
        start = generation.cached_tokens if fed is None else fed
        images, prompt = generation.request.images, generation.request.prompt
        with self.adapted([generation]), prompt_steps():
            if images is not None and start < images.end:  # the prompt cache holds none of it (`Engine.lookup`)
                logits = images.prefill_prompt(self.model, prompt, cache, self.encoded_images)
            else:
                logits = prefill_prompt(self.decoder, prompt[start:], cache, self.prefill_step)
        first = self.first_token(generation, logits[:, -1, :])
        mx.eval(first, pending([generation]), [c.state for c in cache])
        return [generation], cache, first

    def prefill_together(self, group: list[tuple[Generation, list]]) -> Prefilled:
        """The last `tokens` prompt tokens of every member, right-aligned, in one forward pass (and their last column
        in one of its own, as `prefill_prompt` feeds a prompt alone).

        A member keeps the cached tokens before those (feeding again any cached among them); a shorter prompt
        is left-padded inside the pass, its padding hidden from its tokens like the batch's own. One pass
        instead of one per joiner: every weight is read once for all of them, and the CPU's products run
        on many rows at their fastest.
        """
        tokens = max(len(s.request.prompt) - s.cached_tokens for s, _ in group)
        rows, padding = [], []
        for generation, cache in group:
            prompt = generation.request.prompt
            generation.cached_tokens = max(0, len(prompt) - tokens)
            for c in cache:
                c.trim(c.offset - generation.cached_tokens)
            fed = prompt[generation.cached_tokens :]
            rows.append([0] * (tokens - len(fed)) + fed)
            padding.append(tokens - len(fed))
        batch = merged([cache for _, cache in group])
        for layer in batch:  # (a merge of empty caches is empty: no padding yet)
            before = layer.row_padding() if layer.state else [0] * len(group)
            layer.padding = [p + extra for p, extra in zip(before, padding)]
        rows = mx.array(rows, dtype=mx.int32)
        with self.adapted([s for s, _ in group]), prompt_steps():
            if tokens > 1:  # all but the last column, which gets a pass of its own, as `prefill_prompt` gives it alone
                self.decoder(rows[:, :-1], batch, last_only=True)
                mx.eval([c.state for c in marked(batch)])
            logits = self.decoder(rows[:, -1:], batch, last_only=True)
        marked(batch)
        first = mx.concatenate([self.first_token(s, logits[i : i + 1, -1, :]) for i, (s, _) in enumerate(group)])
        mx.eval(first, pending([s for s, _ in group]), [c.state for c in batch])
        return [s for s, _ in group], batch, first

    def first_token(self, generation: Generation, logits: mx.array) -> mx.array:
        """The first answer token (1,), from the logits (1, vocab) of the prompt's last position."""
        if generation.matcher is not None:
            mx.async_eval(logits)  # the prompt's pass runs while the host computes the grammar's first mask
        return self.pick([generation], logits, mx.array(generation.request.prompt[-1:]))

    def decode(self, rows: list[Generation], cache: list, inputs: mx.array, read_previous) -> tuple[mx.array, list]:
        """Queue one step, each row reading its token in `inputs` (rows,): (the sampled tokens (rows,), the outputs
        of the previous step's tokens, which `read_previous()` reads back while this step runs).

        A constrained row's mask depends on the token it is fed, read back from the previous step: then the forward
        pass is queued first, the previous tokens are read (and their grammars advanced) while it runs, and the
        sampling is queued after the masks are made. Otherwise the whole step is queued before the read.
        """
        self.batch_sizes[len(rows)] += 1
        with self.adapted(rows), decode_steps():
            logits = self.decoder(inputs[:, None], cache)[:, -1, :]
        constrained = any(s.matcher is not None for s in rows)
        if constrained:
            mx.async_eval(logits)
            outputs = read_previous()
        tokens = self.pick(rows, logits, inputs)
        mx.async_eval(tokens, [s.logprobs.pending[-1] for s in rows if s.logprobs is not None])
        return tokens, outputs if constrained else read_previous()

    def pick(self, rows: list[Generation], logits: mx.array, inputs: mx.array) -> mx.array:
        """The next token of every row (rows,) from the logits (rows, vocab), `inputs` (rows,) being the tokens
        just fed: constrained rows masked by their grammars, each row sampled by its own settings, and the logprobs
        asked for queued from the model's own logits."""
        raw = logits
        if any(s.matcher is not None for s in rows):
            logits = mx.where(mx.array(grammar_masks(rows, logits.shape)), logits, -mx.inf)
        if all(s.sampling.argmax for s in rows):  # one argmax for the batch, not a slice and one per row
            for s in rows:
                s.sampling.sampled += 1
            plain = all(s.sampling.greedy for s in rows)
            tokens = greedy(logits if plain else logits + self.row_biases(rows, logits.shape[-1]))
        else:
            tokens = mx.concatenate([self.sample(s, logits[i : i + 1], inputs[i : i + 1]) for i, s in enumerate(rows)])
        tokens = self.shared.agree(tokens)
        for i, s in enumerate(rows):
            if s.logprobs is not None:
                s.logprobs.note(raw[i : i + 1], tokens[i : i + 1])
        return tokens

    def row_biases(self, rows: list[Generation], vocab: int) -> mx.array:
        """(rows, vocab) each row's logit bias, stacked once for as long as the batch's rows stay the same."""
        held = self.biases[0] if self.biases is not None else []
        if len(held) != len(rows) or any(a is not b for a, b in zip(held, rows)):
            self.biases = (list(rows), mx.stack([s.sampling.bias_of(vocab) for s in rows]))
        return self.biases[1]

    @staticmethod
    def sample(generation: Generation, logits: mx.array, fed: mx.array) -> mx.array:
        """The row's next token; if its own sampling fails, a placeholder, and the row ends at its next read."""
        try:
            return generation.sample(logits, fed)
        except Exception as e:
            generation.failure = e
            return greedy(logits)

    def speculate(self, generation: Generation, cache: list) -> list[Output]:
        """One round: the drafter proposes tokens after the text, one forward pass scores its last token and the
        drafts, the verifier keeps the drafts the model agrees with and adds a token of the model's, and the cache
        is trimmed back to what was kept. The cache holds every token of the text but the last.

        A generation's first round resets the drafter and starts the verifier's keys at its own next key. A grammar
        checks the drafts up to the first it rejects, and masks the model's logits at every position.
        """
        sampling, speculation = generation.sampling, generation.speculation
        if speculation.verifier is None:
            self.drafter.reset()
            key = sampling.keys[sampling.sampled] if sampling.keys is not None else None
            speculation.verifier = Verifier(generation.request.settings, key)
        context = generation.request.prompt + generation.tokens
        count = min(self.drafter.tokens, generation.max_tokens - sampling.sampled - 1)  # the round's own on top
        drafts, q = self.drafter.draft(context, count, speculation.verifier) if count else ([], None)
        matcher = generation.matcher
        if matcher is not None and drafts:
            drafts = drafts[: matcher.checked(drafts)]
            q = q[: len(drafts)] if q is not None else None
        rollback = Rollback(cache)
        with self.adapted([generation]), decode_steps():  # each draft's check computes as its decode step would
            raw = self.decoder(mx.array([context[-1:] + drafts]), cache)[0]
        logits = raw
        if matcher is not None:
            mx.async_eval(raw)  # the pass runs while the host computes the grammar's mask at each position
            logits = mx.where(mx.array(matcher.masks(drafts)), raw, -mx.inf)
        accepted, token = speculation.verifier.verify(sampling.biased(logits), drafts, q)
        with self.adapted([generation]):  # a recurrent cache re-fed what was kept
            rollback.keep(self.decoder, context[-1:] + drafts[:accepted], len(drafts) - accepted)
        speculation.drafted += len(drafts)
        speculation.accepted += accepted
        new = drafts[:accepted] + [token]
        sampling.sampled += len(new)
        if generation.logprobs is not None:
            generation.logprobs.note(raw[: len(new)], mx.array(new))
            mx.eval(pending([generation]))
        outputs = []
        for token in new:
            outputs.append(generation.read(token))
            if not generation.running:
                break
        return outputs

    def keep(self, generation: Generation, cache: list) -> None:
        """Hand a finished generation's own `cache` to its conversation, or to the prompt cache, evaluated: a row
        selected from the batch is a lazy gather that would keep the whole batch's buffers alive until read."""
        conversation = generation.request.cache is not None
        if not conversation and (self.prompt_cache is None or generation.cancelled or generation.request.adapter):
            return
        mx.eval([c.state for c in cache])
        if conversation:
            generation.cache = cache
            generation.request.cache[:] = cache
        else:  # held by the prompt cache, not by the generation too
            self.prompt_cache.store(generation.cache_ids + generation.tokens, cache, generation.request.cache_key)

    def keep_prefix(self, generation: Generation, cache: list, fed: int) -> None:
        """A prompt cancelled while it prefilled: its fed part goes to the prompt cache, so that a client retrying the
        same request (after its own timeout) starts from there."""
        request = generation.request
        if self.prompt_cache is not None and request.cache is None and request.adapter is None and fed:
            self.prompt_cache.store(generation.cache_ids[:fed], cache, generation.request.cache_key)


def merged(caches: list[list]) -> list:
    """One cache per layer holding the rows of every cache in `caches` (each a list of layers), in order."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def pending(generations: list[Generation]) -> list:
    """The logprobs queued for `generations`' tokens, to evaluate with them."""
    return [list(s.logprobs.pending) for s in generations if s.logprobs is not None]


def grammar_masks(rows: list[Generation], shape: tuple[int, int]) -> np.ndarray:
    """(rows, vocab) the tokens each row's grammar allows (all of them for a row without one, or one that ends)."""
    allowed = np.ones(shape, dtype=bool)
    for i, s in enumerate(rows):
        if s.matcher is not None and s.running and s.failure is None:
            try:
                allowed[i] = s.matcher.allowed()
            except Exception as e:  # this row's grammar alone: it ends at its next read
                s.failure = e
    return allowed
