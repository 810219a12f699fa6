"""The one decode engine: many sequences, one forward pass per step.

`run`, `chat`, `generate`, `batch_generate` and `serve` all drive an `Engine`; a single sequence
is a batch of one. Sequences join and leave at any step (continuous batching), each with its own
prompt length, sampling settings, seed, stop strings and token budget:

- Sequences that join at the same step and need about as many prompt tokens prefill together in one
  pass, right-aligned (a shorter prompt left-padded inside the pass, cached tokens inside it fed again);
  the rest prefill alone. Each first token is sampled from its prompt's last position (so it comes out
  before the next decode step), then the joiners' cache is merged into the batch's, left-padded to the
  longest row (`GrowingBuffer.merge`). The model sees only a cache whose rows have different positions and
  padding; attention reads both from the cache, so core parts know nothing of requests.
- Each step feeds every row its latest token (a decode step, `core.steps.decode_steps`: a device may compute
  it less exactly than a prompt, as the CPU's integer products do), samples each row's logits with that row's own
  sampler and random keys (so a seeded draw does not depend on its neighbours), and queues the
  step (`mx.async_eval`) before reading the previous step's tokens: the host detokenizes while the
  device computes.
- A row with a grammar (`SamplingSettings.constraint`) can only be sampled once its grammar has read the
  token it is fed, so a step holding one queues its forward pass first, reads the previous step's tokens
  while the device runs it, computes the grammar masks on the host, and then queues the sampling, each
  constrained row's logits masked (the other rows' untouched).
- A sequence that finished or was cancelled leaves at the start of the next step; its row of the
  cache is kept when someone wants it (a conversation, or the prompt cache).

The engine chooses how a step runs. A step of one sequence (an engine of one at a time, or a batch down to one
row) decodes through the compiled step where the model has one (`compiled.py`): over caches of a fixed capacity
where the engine holds one sequence at a time and keeps no prompt cache, else over views of the growing caches'
buffers; a batch of several runs the model eagerly. With a drafter (a draft model, or
prompt lookup) each step after the prefill is a speculative round instead (`speculate`, `speculative.py`).

The prompt cache keeps the caches of recent finished sequences by their token ids, so a prompt
that starts the same way (a conversation resent with one more turn) prefills only what follows.
"""

import contextlib
import itertools
import random
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.cache import SINKS, Can, quantized_cache, sink_cache
from ..core.sampling import apply_repetition_penalty, greedy, token_logprobs
from ..core.steps import decode_steps
from ..errors import InvalidSettingError, PromptTooLongError, QueueFullError
from .compiled import decoder
from .grammar import Matcher
from .prefill import prefill, prefill_prompt
from .prompt import vocab_size
from .prompt_cache import PromptCache, PromptFolder
from .settings import SamplingSettings, check_kv_bits, check_whole
from .speculative import DraftModel, PromptLookup, Rollback, Verifier, check_speculation


@dataclass
class Request:
    """What to generate: prompt token ids and this sequence's own settings.

    A seed in the settings makes the draws reproducible (the key of token n is the n-th split of the seed's key);
    `stop_ids` end the sequence (default: the tokenizer's end-of-sequence ids; empty: never); `cache` continues a
    conversation: the prompt then holds only the tokens after it. `cache_key` names the conversation the request
    belongs to (a client's `prompt_cache_key`): the prompt cache keeps one entry per key, its latest.
    """

    prompt: list[int]
    settings: SamplingSettings = SamplingSettings()
    stop_ids: frozenset[int] | None = None
    cache: list | None = None
    cache_key: str | None = None


@dataclass
class Output:
    """One token of one generation, the text it completes (possibly ""), and why the generation ended, if it did."""

    generation: "Generation"
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


class Generation:
    """One request inside the engine: its tokens so far, its sampling state and its text stream."""

    def __init__(self, request: Request, tokenizer, context: int | None):
        self.request = request
        settings = request.settings
        used = request.cache[0].offset if request.cache else 0
        if not request.prompt:
            raise InvalidSettingError("the prompt is empty; give some text")
        needed = used + len(request.prompt)
        if context is not None and needed >= context:
            raise PromptTooLongError(
                f"the prompt needs {needed} positions but the model's context holds {context}; shorten it"
            )
        self.max_tokens = settings.max_tokens if context is None else min(settings.max_tokens, context - needed)
        self.stop_ids = request.stop_ids if request.stop_ids is not None else frozenset(tokenizer.eos_token_ids)
        self.sampler = settings.sampler()
        self.greedy = settings.greedy  # its next token is its logits' argmax alone
        self.argmax = settings.temperature == 0 and settings.repetition_penalty == 1.0  # its biased logits' argmax
        self.seed = settings.seed if settings.seed is not None or settings.temperature == 0 else random.getrandbits(32)
        self.detokenizer = tokenizer.detokenizer() if tokenizer is not None else None
        self.held = ""
        self.tokens: list[int] = []  # generated and read back
        self.sampled = 0  # generated, some maybe still on the device
        self.cached_tokens = 0  # prompt tokens the prompt cache supplied
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended it, if one did
        self.cancelled = False
        self.failure: Exception | None = None  # what failed in this sequence's own step (its next read ends it)
        self.cache: list | None = None  # once it has left the batch: its conversation's cache (request.cache)
        self.keys: mx.array | None = None  # made by the thread that steps the engine: MLX streams belong to a thread
        self.seen: mx.array | None = None  # what the repetition penalty counts
        self.verifier: Verifier | None = None  # speculative rounds: the model's side of each
        self.drafted = self.accepted = 0  # speculative rounds: tokens proposed, and kept by the model
        self.matcher: Matcher | None = None  # a constrained generation's place in its grammar (`Engine.submit`)
        self.bias: mx.array | None = None  # (vocab,) the logit bias, made by the thread that steps the engine
        self.asked = settings.logprobs  # alternatives asked for with each token's logprob (None: no logprobs)
        self.pending: deque[tuple[mx.array, ...]] = deque()  # logprobs of tokens not read yet, lazy

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def running(self) -> bool:
        return self.finish_reason is None and not self.cancelled

    def biased(self, logits: mx.array) -> mx.array:
        """`logits` (rows, vocab) with the settings' logit bias added."""
        if not self.request.settings.logit_bias:
            return logits
        return logits + self.bias_of(logits.shape[-1])

    def bias_of(self, vocab: int) -> mx.array:
        """(vocab,) the settings' logit bias, zeros without one."""
        if self.bias is None:
            self.bias = mx.zeros(vocab)
            if self.request.settings.logit_bias:
                ids, biases = zip(*self.request.settings.logit_bias)
                self.bias = self.bias.at[mx.array(ids)].add(mx.array(biases))
        return self.bias

    def sample(self, logits: mx.array, fed: mx.array) -> mx.array:
        """The next token (1,) from this generation's logits (1, vocab), `fed` (1,) being the token just read."""
        penalty = self.request.settings.repetition_penalty
        if penalty != 1.0:
            self.seen = mx.concatenate([self.seen, fed]) if self.sampled else mx.array(self.request.prompt)
            logits = apply_repetition_penalty(logits, self.seen, penalty)
        logits = self.biased(logits)
        if self.keys is None and self.seed is not None:
            self.keys = mx.random.split(mx.random.key(self.seed), self.max_tokens)
        key = self.keys[self.sampled] if self.keys is not None else None
        self.sampled += 1
        return self.sampler(logits, key)

    def note_logprobs(self, logits: mx.array, tokens: mx.array) -> None:
        """Queue the logprobs asked for of `tokens` (n,) under the model's own `logits` (n, vocab), lazily."""
        chosen, ids, values = token_logprobs(logits, tokens, self.asked)
        self.pending.extend((chosen[i], ids[i], values[i]) for i in range(tokens.size))

    def read(self, token: int) -> Output:
        """The output for the next token read back: its text, held back where a stop string may start. A grammar
        reads the token too: once it is complete, the generation ends (its end-of-sequence id is not text). A
        failure of this sequence alone (its sampler, grammar or detokenizer) ends it with finish_reason "error"."""
        if self.failure is None:
            try:
                return self.read_token(token)
            except Exception as e:  # a bug, or a grammar's: this sequence's, the batch goes on
                self.failure = e
        self.finish_reason = "error"
        return Output(self, token, "", "error")

    def read_token(self, token: int) -> Output:
        self.tokens.append(token)
        end = token in self.stop_ids or (self.matcher is not None and self.matcher.ends(token))
        complete = False
        if self.matcher is not None and not end:
            self.matcher.consume(token)
            complete = self.matcher.stopped
        finish = "stop" if end or complete else "length" if len(self.tokens) == self.max_tokens else None
        text = ""
        if self.detokenizer is not None:
            text = self.held + ("" if end else self.detokenizer.add(token))
            if finish is not None:
                text += self.detokenizer.finalize()
        stop = self.request.settings.stop
        text, self.held, self.stop_string = split_at_stop(text, stop) if stop else (text, "", None)
        if finish is not None and self.stop_string is None:
            text += self.held
        self.finish_reason = "stop" if self.stop_string is not None else finish
        if self.asked is None:
            return Output(self, token, text, self.finish_reason)
        chosen, ids, values = self.pending.popleft()
        top = tuple(zip(ids.tolist(), values.tolist()))
        return Output(self, token, text, self.finish_reason, chosen.item(), top)


def check_max_kv_size(model: nn.Module, max_kv_size: int | None, kv_bits: int | None, max_batch: int) -> None:
    if max_kv_size is None:
        return
    check_whole("max_kv_size", max_kv_size, SINKS + 1)
    if kv_bits is not None:
        raise InvalidSettingError("max_kv_size bounds a float cache; drop kv_bits (or max_kv_size)")
    bounded = [sink_cache(c, max_kv_size) for c in model.make_cache()]
    if max_batch != 1 and not all(c.can(Can.ROWS) for c in bounded):
        raise InvalidSettingError(
            "max_kv_size keeps each sequence's first tokens, which batched sequences of other lengths cannot share; "
            "decode one at a time (--max-batch 1)"
        )
    if not all(c.can(Can.WINDOW) for c in bounded):
        raise InvalidSettingError("max_kv_size bounds key and value caches, not latent attention's; drop it")


# Prompt tokens a prefill group may spend beyond what its members need (re-fed cached tokens, padding):
# about what one more forward pass costs in overhead on a small model.
WASTED_TOKENS = 32


class Engine:
    """Decodes every running sequence in one forward pass per `step()`.

    `submit` and `cancel` may be called from other threads; `step` runs in one thread only. At
    most `max_batch` sequences decode together; up to `max_queue` more wait (QueueFullError beyond).
    `draft_model` (a smaller model sharing the tokenizer, proposing `draft_tokens` a round) or `prompt_lookup=N`
    (N tokens copied from earlier text) decode speculatively, one sequence at a time. `compiled=False` keeps
    the compiled step out (`minimlx bench --eager` compares the two). `kv_bits` (8 or 4) holds every plain KV cache
    quantized (`QuantizedKVCache`; `FixedQuantizedKVCache` for the compiled step), and `max_kv_size` bounds it to the
    first tokens and a window of the latest (`SinkKVCache`, one sequence at a time; such caches decode eagerly). The
    prompt cache keeps `prompt_cache_size` finished sequences (and at most `prompt_cache_bytes` of them), mirrored to
    the folder `prompt_cache_dir` when given.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        max_batch: int = 8,
        max_queue: int | None = None,
        prefill_step: int = 512,
        prompt_cache_size: int = 0,
        draft_model: nn.Module | None = None,
        draft_tokens: int = 3,
        prompt_lookup: int = 0,
        compiled: bool = True,
        kv_bits: int | None = None,
        prompt_cache_bytes: int | None = None,
        prompt_cache_dir: str | None = None,
        max_kv_size: int | None = None,
    ):
        check_whole("prefill_step", prefill_step, 1)
        check_kv_bits(kv_bits)
        check_max_kv_size(model, max_kv_size, kv_bits, max_batch)
        check_speculation((draft_model is not None) + bool(prompt_lookup))
        self.model, self.tokenizer = model, tokenizer
        self.step_guard = getattr(model, "step_guard", contextlib.nullcontext)
        self.max_batch, self.max_queue, self.prefill_step = max_batch, max_queue, prefill_step
        self.kv_bits, self.max_kv_size = kv_bits, max_kv_size
        self.decoder = decoder(model, compiled and max_kv_size is None)
        # a sequence at a time, kept by nobody: caches of a fixed capacity from the start, which the compiled step
        # reads as they are; else growing ones, which batches merge and the prompt cache keeps
        self.fixed_caches = self.decoder is not model and max_batch == 1 and not prompt_cache_size
        self.drafter = None
        if draft_model is not None or prompt_lookup:
            if max_batch != 1:
                raise InvalidSettingError("speculative decoding runs one sequence at a time; use max_batch=1")
            if draft_model is not None and vocab_size(draft_model) != vocab_size(model):
                raise InvalidSettingError(
                    f"the draft model's vocabulary ({vocab_size(draft_model)} tokens) differs from the model's "
                    f"({vocab_size(model)}); the draft model must share the model's tokenizer"
                )
            self.drafter = (
                PromptLookup(prompt_lookup)
                if prompt_lookup
                else DraftModel(decoder(draft_model, compiled), draft_tokens, prefill_step)
            )
        self.context = getattr(getattr(model, "config", None), "max_positions", None)
        if prompt_cache_dir is not None and not prompt_cache_size:
            raise InvalidSettingError("a prompt cache folder needs a prompt cache to keep; give --prompt-cache above 0")
        folder = None
        if prompt_cache_dir is not None:
            folder = PromptFolder(prompt_cache_dir, model, tokenizer, kv_bits, max_kv_size)
        self.prompt_cache = PromptCache(prompt_cache_size, prompt_cache_bytes, folder) if prompt_cache_size else None
        # a model split across processes (minimlx.distributed) gives every one of them the same sampled tokens
        self.agree = getattr(model, "agree", None)
        self.waiting: deque[Generation] = deque()
        # long prompts that joined a running batch, each (generation, its cache, prompt tokens fed so far): one chunk
        # of the first is fed per step, between the batch's decode steps, so that they do not stall it
        self.prefilling: deque[tuple[Generation, list, int]] = deque()
        self.rows: list[Generation] = []  # one per batch row, in row order
        self.admitted: set[Generation] = set()  # taken from the queue and not yet left: prefilling or in a row
        self.cache: list | None = None  # one batch cache per layer
        self.tokens: mx.array | None = None  # (rows,) the last sampled token of each row
        self.unread = False  # whether `tokens` is still to be read back (not when they are first tokens)
        self.biases: tuple[list[Generation], mx.array] | None = None  # `row_biases`: the rows and their biases
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when there is work

    @property
    def compiled(self) -> bool:
        """Whether a decode step of one sequence replays the compiled step."""
        return self.decoder is not self.model

    def make_cache(self) -> list:
        """A cache for one sequence, of the kind this engine's steps decode over."""
        made = (self.decoder if self.fixed_caches else self.model).make_cache()
        return [sink_cache(quantized_cache(c, self.kv_bits), self.max_kv_size) for c in made]

    def submit(self, request: Request) -> Generation:
        settings = request.settings
        check_speculation(self.drafter is not None, settings)
        vocab = vocab_size(self.model)
        for token, _ in settings.logit_bias:
            if vocab is not None and token >= vocab:
                raise InvalidSettingError(
                    f"logit_bias names token {token}, outside the model's vocabulary of {vocab} tokens "
                    f"(0 to {vocab - 1}); drop it",
                    field="logit_bias",
                )
        generation = Generation(request, self.tokenizer, self.context)
        if settings.constraint is not None:
            if self.tokenizer is None:
                raise InvalidSettingError("a constraint needs the tokenizer; give the engine one")
            generation.matcher = Matcher(settings.constraint, self.tokenizer, vocab or self.tokenizer.vocab_size)
        with self.lock:
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self.waiting)} requests are already waiting; try again later")
            self.waiting.append(generation)
        self.wake.set()
        return generation

    def cancel(self, generation: Generation) -> None:
        """Stop `generation`: it leaves the queue at once (a cancelled request holds no place in it), or the batch
        at the next step."""
        generation.cancelled = generation.finish_reason is None
        with self.lock:
            if generation in self.waiting:
                self.waiting.remove(generation)
        self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.prefilling)

    @property
    def running(self) -> int:
        """Sequences taken from the queue that have not left yet (prefilling, or decoding in a row): a cancelled
        one counts until the engine has let it go."""
        return len(self.admitted)

    def step(self) -> list[Output]:
        """One step (`take_step`) under the model's `step_guard`, if it has one: a model split across processes
        ends this one when a step waits on a stopped rank too long."""
        with self.step_guard():
            return self.take_step()

    def take_step(self) -> list[Output]:
        """Admit waiting sequences, queue one decode step for all rows, and return the tokens of the previous one.

        When every row has just joined, the step returns their first tokens before it queues their first decode
        step (the next call does): queuing is not free, as MLX evaluates all but the last ~100 ops of a graph
        before `async_eval` returns, and the first token should not wait for it. The batch (rows, cache, tokens)
        changes only once the new step is queued, so an interrupt (Ctrl-C) leaves it whole. With a drafter, a
        step after the prefill is a speculative round, whose tokens it returns at once.
        """
        read_rows, previous, unread = self.rows, self.tokens, self.unread
        going_on = [i for i, s in enumerate(read_rows) if s.running and s.sampled < s.max_tokens]
        for i, generation in enumerate(read_rows):
            if i not in going_on:
                self.leave(generation, i)
        rows, caches, inputs = [read_rows[i] for i in going_on], [], []
        if going_on:
            caches.append([c.select(going_on) for c in self.cache])
            inputs.append(previous if len(going_on) == len(read_rows) else previous[mx.array(going_on)])
        firsts = []
        for joined, cache, first in self.admit(len(rows)):
            firsts += [s.read(token) for s, token in zip(joined, first.tolist())]
            going = [i for i, s in enumerate(joined) if s.running]
            for i, generation in enumerate(joined):
                if not generation.running:  # its first token ended it
                    self.keep(generation, [c.select([i]) for c in cache])
            if len(going) < len(joined) and going:
                cache, first = [c.select(going) for c in cache], first[mx.array(going)]
            if going:
                rows += [joined[i] for i in going]
                caches.append(cache)
                inputs.append(first)
        cache = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)] if rows else None
        if rows and not going_on and not (read_rows and unread):  # all new, nothing to read: first tokens first
            self.rows, self.cache, self.tokens, self.unread = rows, cache, mx.concatenate(inputs), False
            return firsts
        if self.drafter is not None:  # one generation, past its first token
            self.rows, self.cache, self.tokens, self.unread = rows, cache, None, False
            return self.speculate(rows[0], cache) if rows else firsts

        def read_previous() -> list[Output]:
            if not read_rows or not unread:
                return []
            return [s.read(token) for s, token in zip(read_rows, previous.tolist()) if s.running]

        tokens, outputs = self.decode(rows, cache, mx.concatenate(inputs), read_previous) if rows else (None, None)
        self.rows, self.cache, self.tokens, self.unread = rows, cache, tokens, True
        return (outputs if rows else read_previous()) + firsts

    def admit(self, running: int) -> Iterator:
        """Take waiting sequences while there is room, and prefill them in groups, each (generations, their cache
        (a row each), their first tokens (generations,)), lazily: joiners that need about as many new tokens
        together (`prefill_together`), the others alone. Even a joiner that needs one prompt token alone (the prompt
        cache or its conversation holds the rest) gets a prefill of its own rather than a row of the next decode
        step: its first token then comes from the same kind of pass as when its prompt is fed whole. The first token
        is sampled from the prompt's last position, as in one pass over the whole prompt. While others decode, a
        prompt longer than a prefill chunk is fed a chunk per step instead (`prefill_chunk`): a running stream waits
        one chunk's pass for its next token, not the whole prompt's.
        """
        joiners = []
        while running + len(self.prefilling) + len(joiners) < self.max_batch:
            with self.lock:
                if not self.waiting:
                    break
                generation = self.waiting.popleft()
            if generation.cancelled:
                continue
            self.admitted.add(generation)
            cache = generation.request.cache
            if cache is None and self.prompt_cache is not None:
                generation.cached_tokens, cache = self.prompt_cache.fetch(generation.request.prompt)
            joiners.append((generation, cache if cache is not None else self.make_cache()))
        long = [(s, c) for s, c in joiners if len(s.request.prompt) - s.cached_tokens > self.prefill_step]
        self.prefilling += [(s, cache, s.cached_tokens) for s, cache in long]
        joiners = [joiner for joiner in joiners if joiner not in long]
        groups = self.prefill_groups(joiners)
        alone = (self.prefill_together(g) if len(g) > 1 else self.prefill_alone(*g[0]) for g in groups)
        return itertools.chain(self.prefill_chunk(), alone)

    def prefill_chunk(self) -> list[tuple[list[Generation], list, mx.array]]:
        """Feed the first long prompt of `prefilling` one chunk, or, once what is left fits in one, the rest: then
        it joins the batch as a prefilled group of one. A chunk a step, even with nothing else running: a client
        that hangs up mid-prompt frees the engine at the next step. A cancelled prompt's fed part goes to the
        prompt cache, so that a client retrying the same request (after its own timeout) starts from there."""
        while self.prefilling and self.prefilling[0][0].cancelled:
            generation, cache, fed = self.prefilling.popleft()
            self.admitted.discard(generation)
            if self.prompt_cache is not None and generation.request.cache is None and fed:
                self.prompt_cache.store(generation.request.prompt[:fed], cache, generation.request.cache_key)
        if not self.prefilling:
            return []
        generation, cache, fed = self.prefilling[0]
        prompt = generation.request.prompt
        if len(prompt) - fed > self.prefill_step:
            prefill(self.decoder, prompt[fed : fed + self.prefill_step], cache, self.prefill_step)
            mx.eval([c.state for c in cache])
            self.prefilling[0] = (generation, cache, fed + self.prefill_step)
            return []
        self.prefilling.popleft()
        return [self.prefill_alone(generation, cache, fed)]

    def prefill_groups(self, joiners: list[tuple[Generation, list]]) -> list[list[tuple[Generation, list]]]:
        """Joiners in groups to prefill together, by how many prompt tokens each still needs.

        A group feeds each member as many tokens as the neediest, re-feeding cached ones (or padding): it grows
        while that costs at most WASTED_TOKENS more than the members need, or a quarter more. A continued
        conversation (whose prompt lacks its cached tokens) prefills alone, as does a prompt longer than a
        prefill chunk.
        """

        def needs(joiner):
            return len(joiner[0].request.prompt) - joiner[0].cached_tokens

        def joins(group, joiner):
            tokens, members = needs(joiner), group + [joiner]
            useful = sum(needs(j) for j in members)
            return (
                all(s.request.cache is None for s, _ in members)
                and tokens <= self.prefill_step
                and len(members) * tokens - useful <= max(WASTED_TOKENS, useful // 4)
                and all(c.keeps(max(0, len(s.request.prompt) - tokens)) for s, cache in members for c in cache)
            )

        groups = []
        for joiner in sorted(joiners, key=needs):  # a group's neediest member is its last
            if groups and joins(groups[-1], joiner):
                groups[-1].append(joiner)
            else:
                groups.append([joiner])
        return groups

    def prefill_alone(
        self, generation: Generation, cache: list, fed: int | None = None
    ) -> tuple[list[Generation], list, mx.array]:
        """Feed the prompt from token `fed` (its cached tokens by default) and sample the first token."""
        start = generation.cached_tokens if fed is None else fed
        logits = prefill_prompt(self.decoder, generation.request.prompt[start:], cache, self.prefill_step)
        first = self.first_token(generation, logits[:, -1, :])
        mx.eval(first, list(generation.pending), [c.state for c in cache])
        return [generation], cache, first

    def prefill_together(self, group: list[tuple[Generation, list]]) -> tuple[list[Generation], list, mx.array]:
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
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*(cache for _, cache in group))]
        for layer in batch:  # (a merge of empty caches is empty: no padding yet)
            before = layer.row_padding() if layer.state else [0] * len(group)
            layer.padding = [p + extra for p, extra in zip(before, padding)]
        rows = mx.array(rows, dtype=mx.int32)
        if tokens > 1:  # all but the last column, which gets a pass of its own, as `prefill_prompt` gives it alone
            self.decoder(rows[:, :-1], batch, last_only=True)
            mx.eval([c.state for c in batch])
        logits = self.decoder(rows[:, -1:], batch, last_only=True)
        first = mx.concatenate([self.first_token(s, logits[i : i + 1, -1, :]) for i, (s, _) in enumerate(group)])
        mx.eval(first, [list(s.pending) for s, _ in group], [c.state for c in batch])
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
        with decode_steps():
            logits = self.decoder(inputs[:, None], cache)[:, -1, :]
        constrained = any(s.matcher is not None for s in rows)
        if constrained:
            mx.async_eval(logits)
            outputs = read_previous()
        tokens = self.pick(rows, logits, inputs)
        mx.async_eval(tokens, [s.pending[-1] for s in rows if s.asked is not None])
        return tokens, outputs if constrained else read_previous()

    def pick(self, rows: list[Generation], logits: mx.array, inputs: mx.array) -> mx.array:
        """The next token of every row (rows,) from the logits (rows, vocab), `inputs` (rows,) being the tokens
        just fed: constrained rows masked by their grammars, each row sampled by its own settings, and the logprobs
        asked for queued from the model's own logits."""
        raw = logits
        if any(s.matcher is not None for s in rows):
            allowed = np.ones(logits.shape, dtype=bool)
            for i, s in enumerate(rows):
                if s.matcher is not None and s.running and s.failure is None:
                    try:
                        allowed[i] = s.matcher.allowed()
                    except Exception as e:  # this row's grammar alone: it ends at its next read
                        s.failure = e
            logits = mx.where(mx.array(allowed), logits, -mx.inf)
        if all(s.argmax for s in rows):  # one argmax for the batch, not a slice and one per row
            for s in rows:
                s.sampled += 1
            tokens = greedy(logits if all(s.greedy for s in rows) else logits + self.row_biases(rows, logits.shape[-1]))
        else:
            tokens = mx.concatenate([self.sample(s, logits[i : i + 1], inputs[i : i + 1]) for i, s in enumerate(rows)])
        if self.agree is not None:
            tokens = self.agree(tokens)
        for i, s in enumerate(rows):
            if s.asked is not None:
                s.note_logprobs(raw[i : i + 1], tokens[i : i + 1])
        return tokens

    def row_biases(self, rows: list[Generation], vocab: int) -> mx.array:
        """(rows, vocab) each row's logit bias, stacked once for as long as the batch's rows stay the same."""
        held = self.biases[0] if self.biases is not None else []
        if len(held) != len(rows) or any(a is not b for a, b in zip(held, rows)):
            self.biases = (list(rows), mx.stack([s.bias_of(vocab) for s in rows]))
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
        if generation.verifier is None:
            self.drafter.reset()
            key = generation.keys[generation.sampled] if generation.keys is not None else None
            generation.verifier = Verifier(generation.request.settings, key)
        context = generation.request.prompt + generation.tokens
        count = min(self.drafter.tokens, generation.max_tokens - generation.sampled - 1)  # the round's own on top
        drafts, q = self.drafter.draft(context, count, generation.verifier) if count else ([], None)
        matcher = generation.matcher
        if matcher is not None and drafts:
            drafts = drafts[: matcher.checked(drafts)]
            q = q[: len(drafts)] if q is not None else None
        rollback = Rollback(cache)
        with decode_steps():  # the check of each draft computes as the decode step it stands for
            raw = self.decoder(mx.array([context[-1:] + drafts]), cache)[0]
        logits = raw
        if matcher is not None:
            mx.async_eval(raw)  # the pass runs while the host computes the grammar's mask at each position
            logits = mx.where(mx.array(matcher.masks(drafts)), raw, -mx.inf)
        accepted, token = generation.verifier.verify(generation.biased(logits), drafts, q)
        rollback.keep(self.decoder, context[-1:] + drafts[:accepted], len(drafts) - accepted)
        generation.drafted += len(drafts)
        generation.accepted += accepted
        new = drafts[:accepted] + [token]
        generation.sampled += len(new)
        if generation.asked is not None:
            generation.note_logprobs(raw[: len(new)], mx.array(new))
            mx.eval(list(generation.pending))
        outputs = []
        for token in new:
            outputs.append(generation.read(token))
            if not generation.running:
                break
        return outputs

    def leave(self, generation: Generation, row: int) -> None:
        """Take `generation` (row `row`) out of the batch, keeping its cache when someone wants it."""
        self.keep(generation, [c.select([row]) for c in self.cache])

    def keep(self, generation: Generation, cache: list) -> None:
        """Hand a finished generation's own `cache` to its conversation, or to the prompt cache, evaluated: a row
        selected from the batch is a lazy gather that would keep the whole batch's buffers alive until read."""
        self.admitted.discard(generation)
        conversation = generation.request.cache is not None
        if not conversation and (self.prompt_cache is None or generation.cancelled):
            return
        mx.eval([c.state for c in cache])
        if conversation:
            generation.cache = cache
            generation.request.cache[:] = cache
        else:  # held by the prompt cache, not by the generation too
            self.prompt_cache.store(generation.request.prompt + generation.tokens, cache, generation.request.cache_key)

    def clear(self) -> None:
        """Drop every sequence, running or waiting (after a step failed)."""
        with self.lock:
            self.waiting.clear()
        self.prefilling.clear()
        self.admitted.clear()
        self.rows, self.cache, self.tokens, self.unread, self.biases = [], None, None, False, None

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while self.busy:
            self.step()
