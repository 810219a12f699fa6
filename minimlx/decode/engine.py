"""The one decode engine: many sequences, one forward pass per step. Each step is schedule -> run -> emit: the
`Scheduler` (no model) plans which rows go on, which leave and what prefills, the `Runner` executes the plan on the
model, and each `Generation` turns the tokens read back into `Output`s.

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

import threading
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn

from ..core.cache import quantized_cache, sink_cache
from ..errors import InvalidSettingError
from .adapters import Adapters
from .checks import check_max_kv_size
from .compiled import decoder
from .generation import Generation, Request
from .images import IMAGE_CACHE_MB, EncodedImages
from .output import Output, split_at_stop
from .prompt import vocab_size
from .prompt_cache import PromptCache, PromptFolder
from .runner import Batch, Runner, SharedSteps, merged
from .scheduler import Plan, Scheduler
from .settings import check_kv_bits, check_whole
from .speculative import DraftModel, PromptLookup, check_speculation

__all__ = ["Engine", "Generation", "Output", "Request", "split_at_stop"]


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
    the folder `prompt_cache_dir` when given. `adapters` (`Adapters`, attached to `model`) lets each request name
    the adapter it decodes with: rows of different adapters share every step, which then runs eagerly; the prompt
    cache keeps only sequences on the base model. The soft tokens of the images read are kept by their pixels' digest
    (`EncodedImages`, at most `image_cache_bytes`), so that an image read again is not encoded again.
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
        adapters: Adapters | None = None,
        image_cache_bytes: int = IMAGE_CACHE_MB * 2**20,
    ):
        check_whole("prefill_step", prefill_step, 1)
        check_kv_bits(kv_bits)
        check_max_kv_size(model, max_kv_size, kv_bits, max_batch)
        check_speculation((draft_model is not None) + bool(prompt_lookup))
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue, self.prefill_step = max_batch, max_queue, prefill_step
        self.kv_bits, self.max_kv_size = kv_bits, max_kv_size
        self.adapters = adapters
        # the rows' adapters change between steps: a traced step would replay the first ones
        self.decoder = decoder(model, compiled and max_kv_size is None and adapters is None)
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
        self.context = model.config.max_positions if model.config is not None else None  # (`Transformer.config`)
        if prompt_cache_dir is not None and not prompt_cache_size:
            raise InvalidSettingError("a prompt cache folder needs a prompt cache to keep; give --prompt-cache above 0")
        folder = None
        if prompt_cache_dir is not None:
            folder = PromptFolder(prompt_cache_dir, model, tokenizer, kv_bits, max_kv_size)
        self.prompt_cache = PromptCache(prompt_cache_size, prompt_cache_bytes, folder) if prompt_cache_size else None
        # a model split across processes (minimlx.distributed) guards each step and agrees on the sampled tokens
        self.shared = model if isinstance(model, SharedSteps) else SharedSteps()
        self.scheduler = Scheduler(max_batch, max_queue, prefill_step, self.lookup, keeps)
        self.encoded_images = EncodedImages(image_cache_bytes)
        steps = (self.decoder, prefill_step, self.drafter, self.shared, self.prompt_cache, adapters)
        self.runner = Runner(*steps, model=model, encoded_images=self.encoded_images)
        self.batch = Batch([])
        self.lock = self.scheduler.lock
        self.wake = threading.Event()  # set when there is work

    @property
    def compiled(self) -> bool:
        """Whether a decode step of one sequence replays the compiled step."""
        return self.decoder is not self.model

    def make_cache(self) -> list:
        """A cache for one sequence, of the kind this engine's steps decode over."""
        made = (self.decoder if self.fixed_caches else self.model).make_cache()
        return [sink_cache(quantized_cache(c, self.kv_bits), self.max_kv_size) for c in made]

    def lookup(self, generation: Generation) -> tuple[int, list]:
        """A joiner's cache (its conversation's, the prompt cache's longest match, or a fresh one) and the prompt
        tokens it holds: a prompt with images reuses a cache only where it holds them all."""
        cache = generation.request.cache
        cached = 0
        if cache is None and self.prompt_cache is not None and generation.request.adapter is None:
            cached, cache = self.prompt_cache.fetch(generation.cache_ids)
            images = generation.request.images
            if images is not None and cached < images.end:  # images are read in one first pass, from the start
                cached, cache = 0, None
        return cached, cache if cache is not None else self.make_cache()

    def submit(self, request: Request) -> Generation:
        settings = request.settings
        check_speculation(self.drafter is not None, settings)
        if request.adapter is not None:
            if self.adapters is None:
                raise InvalidSettingError(f"adapter {request.adapter!r} asked, but no adapters are served", "adapter")
            self.adapters.index_of(request.adapter)
        vocab = vocab_size(self.model)
        for token, _ in settings.logit_bias:
            if vocab is not None and token >= vocab:
                raise InvalidSettingError(
                    f"logit_bias names token {token}, outside the model's vocabulary of {vocab} tokens "
                    f"(0 to {vocab - 1}); drop it",
                    field="logit_bias",
                )
        generation = Generation(request, self.tokenizer, self.context, vocab)
        self.scheduler.submit(generation)
        self.wake.set()
        return generation

    def cancel(self, generation: Generation) -> None:
        """Stop `generation`: it leaves the queue at once (a cancelled request holds no place in it), or the batch
        at the next step."""
        generation.cancelled = generation.finish_reason is None
        self.scheduler.cancel(generation)
        self.wake.set()

    @property
    def waiting(self):
        """The sequences waiting to join (in order)."""
        return self.scheduler.waiting

    @property
    def rows(self) -> list[Generation]:
        """The batch's sequences, one per row, in row order."""
        return self.batch.rows

    @property
    def busy(self) -> bool:
        return bool(self.batch.rows) or self.scheduler.busy

    @property
    def running(self) -> int:
        """Sequences taken from the queue that have not left yet (prefilling, or decoding in a row): a cancelled
        one counts until the engine has let it go."""
        return len(self.scheduler.admitted)

    def step_guard(self):
        return self.shared.step_guard()

    def step(self) -> list[Output]:
        """One step (`take_step`) under the model's `step_guard`: a model split across processes ends this one when
        a step waits on a stopped rank too long."""
        with self.step_guard():
            return self.take_step()

    def take_step(self) -> list[Output]:
        """Schedule, run, emit: the rows that leave hand on their caches, the plan's chunk and prefills run (their
        first tokens read), and one decode step is queued for all rows; returns the tokens of the previous one.

        When every row has just joined, the step returns their first tokens before it queues their first decode
        step (the next call does): queuing is not free, as MLX evaluates all but the last ~100 ops of a graph
        before `async_eval` returns, and the first token should not wait for it. The batch changes only once the
        new step is queued, so an interrupt (Ctrl-C) leaves it whole. With a drafter, a step after the prefill is a
        speculative round, whose tokens it returns at once.
        """
        before = self.batch
        plan = self.scheduler.schedule(before.rows, self.release)
        rows, caches, inputs = [before.rows[i] for i in plan.going_on], [], []
        if plan.going_on:
            caches.append([c.select(plan.going_on) for c in before.cache])
            all_rows = len(plan.going_on) == len(before.rows)
            inputs.append(before.tokens if all_rows else before.tokens[mx.array(plan.going_on)])
        firsts = []
        for joined, cache, first in self.prefilled(plan):
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
        cache = merged(caches) if rows else None
        if rows and not plan.going_on and not (before.rows and before.unread):  # all new: first tokens first
            self.batch = Batch(rows, cache, mx.concatenate(inputs))
            return firsts
        if self.drafter is not None:  # one generation, past its first token
            self.batch = Batch(rows, cache)
            return self.runner.speculate(rows[0], cache) if rows else firsts

        def read_previous() -> list[Output]:
            if not before.rows or not before.unread:
                return []
            return [s.read(token) for s, token in zip(before.rows, before.tokens.tolist()) if s.running]

        if not rows:
            self.batch = Batch([])
            return read_previous() + firsts
        tokens, outputs = self.runner.decode(rows, cache, mx.concatenate(inputs), read_previous)
        self.batch = Batch(rows, cache, tokens, True)
        return outputs + firsts

    def prefilled(self, plan: Plan) -> Iterator:
        """Run the plan's prefills, lazily: the cancelled long prompts hand on what they fed, a chunk is fed, and
        each prefill gives (generations, their cache (a row each), their first tokens (generations,))."""
        for generation, cache, fed in plan.dropped:
            self.runner.keep_prefix(generation, cache, fed)
        if plan.chunk is not None:
            self.runner.feed(plan.chunk)
        return map(self.runner.prefill, plan.prefills)

    def release(self, leaving: list[int]) -> None:
        """The batch's rows `leaving` hand on their caches (`keep`)."""
        for i in leaving:
            self.keep(self.batch.rows[i], [c.select([i]) for c in self.batch.cache])

    def keep(self, generation: Generation, cache: list) -> None:
        self.scheduler.left(generation)
        self.runner.keep(generation, cache)

    def clear(self) -> None:
        """Drop every sequence, running or waiting (after a step failed)."""
        self.scheduler.clear()
        self.batch, self.runner.biases = Batch([]), None

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while self.busy:
            self.step()


def keeps(cache: list, tokens: int) -> bool:
    """Whether every layer of `cache` can be trimmed back to its first `tokens`."""
    return all(c.keeps(tokens) for c in cache)
