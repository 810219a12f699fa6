"""The one decode engine: many sequences, one forward pass per step.

`run`, `chat`, `generate`, `batch_generate` and `serve` all drive an `Engine`; a single sequence
is a batch of one. Sequences join and leave at any step (continuous batching), each with its own
prompt length, sampling settings, seed, stop strings and token budget:

- Sequences that join at the same step and need about as many prompt tokens prefill together in one
  pass, right-aligned (a shorter prompt left-padded inside the pass, cached tokens inside it fed again);
  the rest prefill alone. Each first token is sampled from its prompt's last position (so it comes out
  before the next decode step), then the joiners' cache is merged into the batch's, left-padded to the
  longest row (`GrowingBuffer.merge`). A joiner that needs one prompt token alone (the prompt cache holds
  the rest) skips the prefill while others decode: it rides their next step, its last prompt token fed
  there. The model sees only a cache whose rows have different positions and padding; attention reads
  both from the cache, so core parts know nothing of requests.
- Each step feeds every row its latest token, samples each row's logits with that row's own
  sampler and random keys (so a seeded draw does not depend on its neighbours), and queues the
  step (`mx.async_eval`) before reading the previous step's tokens, as `generate.py`'s loop did:
  the host detokenizes while the device computes.
- A sequence that finished or was cancelled leaves at the start of the next step; its row of the
  cache is kept when someone wants it (a conversation, or the prompt cache).

The prompt cache keeps the caches of recent finished sequences by their token ids, so a prompt
that starts the same way (a conversation resent with one more turn) prefills only what follows.
"""

import random
import threading
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .checks import check_generation, check_whole
from .core.sampling import Sampler, apply_repetition_penalty, check_settings, greedy, make_sampler
from .errors import InvalidSettingError, PromptTooLongError, QueueFullError


@dataclass
class Request:
    """What to generate: prompt token ids and this sequence's own settings.

    `seed` makes the draws reproducible (the key of token n is the n-th split of the seed's key);
    `stop_ids` end the sequence (default: the tokenizer's end-of-sequence ids; empty: never);
    `cache` continues a conversation: the prompt then holds only the tokens after it.
    """

    prompt: list[int]
    max_tokens: int = 256
    sampler: Sampler = field(default_factory=make_sampler)
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: Sequence_[str] = ()
    stop_ids: frozenset[int] | None = None
    cache: list | None = None


def check_generation_settings(
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> None:
    """Refuse settings that mean nothing (InvalidSettingError naming the allowed range), before any work."""
    check_settings(temperature, top_p, top_k, min_p, repetition_penalty)
    if max_tokens < 1:
        raise InvalidSettingError(f"max_tokens must be at least 1, got {max_tokens}")


def make_request(
    prompt: list[int],
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: Sequence_[str] | None = None,
    cache: list | None = None,
) -> Request:
    """A request from sampling settings, checked (InvalidSettingError) before any work."""
    stop = check_generation(max_tokens, seed, stop)
    check_generation_settings(max_tokens, temperature, top_p, top_k, min_p, repetition_penalty)
    if temperature > 0 and seed is None:
        seed = random.getrandbits(32)
    sampler = make_sampler(temperature, top_p, top_k, min_p)
    return Request(list(prompt), max_tokens, sampler, seed, repetition_penalty, stop, cache=cache)


@dataclass
class Output:
    """One token of one sequence, the text it completes (possibly ""), and why the sequence ended, if it did."""

    sequence: "Sequence"
    token: int
    text: str
    finish_reason: str | None  # "stop" (an end id or a stop string), "length", None while it goes on


def split_at_stop(text: str, stop: Sequence_[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text held back because a stop string may start there, whether a stop string ended it)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    if found:
        return text[: min(found)], "", True
    held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held], text[len(text) - held :], False


class Sequence:
    """One request inside the engine: its tokens so far, its sampling state and its text stream."""

    def __init__(self, request: Request, tokenizer, context: int | None):
        self.request = request
        used = request.cache[0].offset if request.cache else 0
        if not request.prompt:
            raise InvalidSettingError("the prompt is empty; give some text")
        needed = used + len(request.prompt)
        if context is not None and needed >= context:
            raise PromptTooLongError(
                f"the prompt needs {needed} positions but the model's context holds {context}; shorten it"
            )
        self.max_tokens = request.max_tokens if context is None else min(request.max_tokens, context - needed)
        self.stop_ids = request.stop_ids if request.stop_ids is not None else frozenset(tokenizer.eos_token_ids)
        self.detokenizer = tokenizer.detokenizer() if tokenizer is not None else None
        self.held = ""
        self.tokens: list[int] = []  # generated and read back
        self.sampled = 0  # generated, some maybe still on the device
        self.cached_tokens = 0  # prompt tokens the prompt cache supplied
        self.finish_reason: str | None = None
        self.cancelled = False
        self.cache: list | None = None  # once it has left the batch: the cache of its prompt and answer
        self.keys: mx.array | None = None  # made by the thread that steps the engine: MLX streams belong to a thread
        self.seen: mx.array | None = None  # what the repetition penalty counts

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def running(self) -> bool:
        return self.finish_reason is None and not self.cancelled

    @property
    def greedy(self) -> bool:
        """Whether its next token is its logits' argmax alone (no penalty, no draw)."""
        return self.request.sampler is greedy and self.request.repetition_penalty == 1.0

    def sample(self, logits: mx.array, fed: mx.array) -> mx.array:
        """The next token (1,) from this sequence's logits (1, vocab), `fed` (1,) being the token just read."""
        if self.request.repetition_penalty != 1.0:
            self.seen = mx.concatenate([self.seen, fed]) if self.sampled else mx.array(self.request.prompt)
            logits = apply_repetition_penalty(logits, self.seen, self.request.repetition_penalty)
        if self.keys is None and self.request.seed is not None:
            self.keys = mx.random.split(mx.random.key(self.request.seed), self.max_tokens)
        key = self.keys[self.sampled] if self.keys is not None else None
        self.sampled += 1
        return self.request.sampler(logits, key)

    def read(self, token: int) -> Output:
        """The output for the next token read back: its text, held back where a stop string may start."""
        self.tokens.append(token)
        end = token in self.stop_ids
        finish = "stop" if end else "length" if len(self.tokens) == self.max_tokens else None
        text = ""
        if self.detokenizer is not None:
            text = self.held + ("" if end else self.detokenizer.add(token))
            if finish is not None:
                text += self.detokenizer.finalize()
        stop = self.request.stop
        text, self.held, stopped = split_at_stop(text, stop) if stop else (text, "", False)
        if finish is not None and not stopped:
            text += self.held
        self.finish_reason = "stop" if stopped else finish
        return Output(self, token, text, self.finish_reason)


class PromptCache:
    """The caches of the last `size` finished sequences, by token ids, for prompts that start the same way."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list[tuple[list[int], list]] = []  # oldest first

    def store(self, ids: list[int], cache: list) -> None:
        count = min(len(ids), cache[0].offset)
        if not all(c.keeps(count) for c in cache):
            return  # a sliding-window layer has dropped tokens it would need
        for c in cache:
            c.trim(c.offset - count)
        ids = ids[:count]
        shorter = [(i, c) for i, c in self.entries if ids[: len(i)] == i]  # the new entry holds all they hold
        self.entries = ([entry for entry in self.entries if entry not in shorter] + [(ids, cache)])[-self.size :]

    def fetch(self, prompt: list[int]) -> tuple[int, list | None]:
        """(tokens reused, a fresh cache holding them) for the entry sharing the longest start with `prompt`;
        the last prompt token is always left to feed."""
        best, found = 0, None
        for ids, cache in self.entries:
            shared = 0
            limit = min(len(ids), len(prompt) - 1)
            while shared < limit and ids[shared] == prompt[shared]:
                shared += 1
            if shared > best and all(c.keeps(shared) for c in cache):
                best, found = shared, cache
        if found is None:
            return 0, None
        return best, [c.prefix(best) for c in found]


# Prompt tokens a prefill group may spend beyond what its members need (re-fed cached tokens, padding):
# about what one more forward pass costs in overhead on a small model.
WASTED_TOKENS = 32


class Engine:
    """Decodes every running sequence in one forward pass per `step()`.

    `submit` and `cancel` may be called from other threads; `step` runs in one thread only. At
    most `max_batch` sequences decode together; up to `max_queue` more wait (QueueFullError beyond).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        max_batch: int = 8,
        max_queue: int | None = None,
        prefill_step: int = 512,
        prompt_cache_size: int = 0,
    ):
        self.model, self.tokenizer = model, tokenizer
        check_whole("prefill_step", prefill_step, 1)
        self.max_batch, self.max_queue, self.prefill_step = max_batch, max_queue, prefill_step
        self.context = getattr(getattr(model, "config", None), "max_positions", None)
        self.prompt_cache = PromptCache(prompt_cache_size) if prompt_cache_size else None
        # a model split across processes (minimlx.distributed) gives every one of them the same sampled tokens
        self.agree = getattr(model, "agree", None)
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # one per batch row, in row order
        self.cache: list | None = None  # one batch cache per layer
        self.tokens: mx.array | None = None  # (rows,) the last sampled token of each row
        self.unread = False  # whether `tokens` is still to be read back (not when they are first tokens)
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when there is work

    def submit(self, request: Request) -> Sequence:
        sequence = Sequence(request, self.tokenizer, self.context)
        with self.lock:
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self.waiting)} requests are already waiting; try again later")
            self.waiting.append(sequence)
        self.wake.set()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop `sequence`; it leaves the batch at the next step (or the queue, if it has not started)."""
        sequence.cancelled = sequence.finish_reason is None
        self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def step(self) -> list[Output]:
        """Admit waiting sequences, queue one decode step for all rows, and return the tokens of the previous one.

        An engine that was idle returns the first tokens of the sequences it admitted before it queues their
        first decode step (the next call does): queuing is not free, as MLX evaluates all but the last ~100
        ops of a graph before `async_eval` returns (a float32 SmolLM2 step: 40 of its 50 ms), and the first
        token should not wait for it. The batch (rows, cache, tokens) changes only once the new step is
        queued, so an interrupt (Ctrl-C) leaves it whole.
        """
        read_rows, previous, unread = self.rows, self.tokens, self.unread
        going_on = [i for i, s in enumerate(read_rows) if s.running and s.sampled < s.max_tokens]
        for i, sequence in enumerate(read_rows):
            if i not in going_on:
                self.leave(sequence, i)
        rows, caches, inputs = [read_rows[i] for i in going_on], [], []
        if going_on:
            caches.append([c.select(going_on) for c in self.cache])
            inputs.append(previous if len(going_on) == len(read_rows) else previous[mx.array(going_on)])
        firsts = []
        riders, groups = self.admit(len(rows))
        for sequence, cache in riders:  # its last prompt token is fed in the decode step, its first token sampled there
            rows.append(sequence)
            caches.append(cache)
            inputs.append(mx.array(sequence.request.prompt[-1:], dtype=mx.uint32))
        for joined, cache, first in groups:
            firsts += [s.read(token) for s, token in zip(joined, first.tolist())]
            going = [i for i, s in enumerate(joined) if s.running]
            for i, sequence in enumerate(joined):
                if not sequence.running:  # its first token ended it
                    self.keep(sequence, [c.select([i]) for c in cache])
            if len(going) < len(joined) and going:
                cache, first = [c.select(going) for c in cache], first[mx.array(going)]
            if going:
                rows += [joined[i] for i in going]
                caches.append(cache)
                inputs.append(first)
        cache = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)] if rows else None
        if rows and not read_rows:  # idle until now: the first tokens go out first
            self.rows, self.cache, self.tokens, self.unread = rows, cache, mx.concatenate(inputs), False
            return firsts
        tokens = self.decode(rows, cache, mx.concatenate(inputs)) if rows else None
        self.rows, self.cache, self.tokens, self.unread = rows, cache, tokens, True
        if not read_rows or not unread:
            return firsts
        return [s.read(token) for s, token in zip(read_rows, previous.tolist()) if s.running] + firsts

    def admit(self, running: int) -> tuple[list[tuple[Sequence, list]], Iterator]:
        """Take waiting sequences while there is room: (riders, prefilled groups).

        A rider needs one prompt token alone (the prompt cache or its conversation holds the rest), and `running`
        sequences decode already: it joins their next step as they do, its last prompt token fed where theirs is
        the one they sampled, for the price of one more row instead of a forward pass of its own. Riders come as
        (sequence, cache). The others prefill in groups, each (sequences, their cache (a row each), their first
        tokens (sequences,)), lazily: joiners that need about as many new tokens together (`prefill_together`),
        the others alone. The first token is sampled from the prompt's last position, as in one pass over the
        whole prompt.
        """
        joiners = []
        while running + len(joiners) < self.max_batch:
            with self.lock:
                if not self.waiting:
                    break
                sequence = self.waiting.popleft()
            if sequence.cancelled:
                continue
            cache = sequence.request.cache
            if cache is None and self.prompt_cache is not None:
                sequence.cached_tokens, cache = self.prompt_cache.fetch(sequence.request.prompt)
            joiners.append((sequence, cache if cache is not None else self.model.make_cache()))
        rides = [running > 0 and len(s.request.prompt) - s.cached_tokens == 1 for s, _ in joiners]
        riders = [joiner for joiner, ride in zip(joiners, rides) if ride]
        groups = self.prefill_groups([joiner for joiner, ride in zip(joiners, rides) if not ride])
        return riders, (self.prefill_together(g) if len(g) > 1 else self.prefill_alone(*g[0]) for g in groups)

    def prefill_groups(self, joiners: list[tuple[Sequence, list]]) -> list[list[tuple[Sequence, list]]]:
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

    def prefill_alone(self, sequence: Sequence, cache: list) -> tuple[list[Sequence], list, mx.array]:
        ids = mx.array(sequence.request.prompt[sequence.cached_tokens :], dtype=mx.int32)
        for start in range(0, ids.size, self.prefill_step):
            logits = self.model(ids[None, start : start + self.prefill_step], cache, last_only=True)
            if start + self.prefill_step < ids.size:
                mx.eval([c.state for c in cache])
        first = self.first_token(sequence, logits[:, -1, :])
        mx.eval(first, [c.state for c in cache])
        return [sequence], cache, first

    def prefill_together(self, group: list[tuple[Sequence, list]]) -> tuple[list[Sequence], list, mx.array]:
        """One forward pass over the last `tokens` prompt tokens of every member, right-aligned.

        A member keeps the cached tokens before those (feeding again any cached among them); a shorter prompt
        is left-padded inside the pass, its padding hidden from its tokens like the batch's own. One pass
        instead of one per joiner: every weight is read once for all of them, and the CPU's products run
        on many rows at their fastest.
        """
        tokens = max(len(s.request.prompt) - s.cached_tokens for s, _ in group)
        rows, padding = [], []
        for sequence, cache in group:
            prompt = sequence.request.prompt
            sequence.cached_tokens = max(0, len(prompt) - tokens)
            for c in cache:
                c.trim(c.offset - sequence.cached_tokens)
            fed = prompt[sequence.cached_tokens :]
            rows.append([0] * (tokens - len(fed)) + fed)
            padding.append(tokens - len(fed))
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*(cache for _, cache in group))]
        for layer in batch:  # (a merge of empty caches is empty: no padding yet)
            before = layer.row_padding() if layer.state else [0] * len(group)
            layer.padding = [p + extra for p, extra in zip(before, padding)]
        logits = self.model(mx.array(rows, dtype=mx.int32), batch, last_only=True)
        first = mx.concatenate([self.first_token(s, logits[i : i + 1, -1, :]) for i, (s, _) in enumerate(group)])
        mx.eval(first, [c.state for c in batch])
        return [s for s, _ in group], batch, first

    def first_token(self, sequence: Sequence, logits: mx.array) -> mx.array:
        """The first answer token (1,), from the logits (1, vocab) of the prompt's last position."""
        first = sequence.sample(logits, mx.array(sequence.request.prompt[-1:]))
        return self.agree(first) if self.agree is not None else first

    def decode(self, rows: list[Sequence], cache: list, inputs: mx.array) -> mx.array:
        """Queue one step: each row reads its token in `inputs` (rows,); returns the sampled tokens (rows,)."""
        logits = self.model(inputs[:, None], cache)[:, -1, :]
        if all(s.greedy for s in rows):  # one argmax for the batch instead of a slice and an argmax per row
            for s in rows:
                s.sampled += 1
            tokens = greedy(logits)
        else:
            tokens = mx.concatenate([s.sample(logits[i : i + 1], inputs[i : i + 1]) for i, s in enumerate(rows)])
        if self.agree is not None:
            tokens = self.agree(tokens)
        mx.async_eval(tokens)
        return tokens

    def leave(self, sequence: Sequence, row: int) -> None:
        """Take `sequence` (row `row`) out of the batch, keeping its cache when someone wants it."""
        self.keep(sequence, [c.select([row]) for c in self.cache])

    def keep(self, sequence: Sequence, cache: list) -> None:
        """Hand a finished sequence's own `cache` to its conversation, or to the prompt cache."""
        if sequence.request.cache is None and self.prompt_cache is None:
            return
        sequence.cache = cache
        if sequence.request.cache is not None:
            sequence.request.cache[:] = cache
        elif not sequence.cancelled:
            self.prompt_cache.store(sequence.request.prompt + sequence.tokens, cache)

    def clear(self) -> None:
        """Drop every sequence, running or waiting (after a step failed)."""
        with self.lock:
            self.waiting.clear()
        self.rows, self.cache, self.tokens, self.unread = [], None, None, False

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while self.busy:
            self.step()
