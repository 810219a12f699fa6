"""A request and its generation inside the engine: the tokens so far, and small parts with one job each (its
sampling, its grammar, its speculative rounds, its text and logprobs)."""

import random
from dataclasses import dataclass

import mlx.core as mx

from ..core.sampling import apply_repetition_penalty
from ..errors import InvalidSettingError, PromptTooLongError
from .grammar import Matcher
from .images import PromptImages
from .output import Logprobs, Output, TextStream
from .settings import SamplingSettings
from .speculative import Verifier


@dataclass
class Request:
    """What to generate: prompt token ids and this sequence's own settings.

    A seed in the settings makes the draws reproducible (the key of token n is the n-th split of the seed's key);
    `stop_ids` end the sequence (default: the tokenizer's end-of-sequence ids; empty: never); `cache` continues a
    conversation: the prompt then holds only the tokens after it. `cache_key` names the conversation the request
    belongs to (a client's `prompt_cache_key`): the prompt cache keeps one entry per key, its latest. `adapter`
    names one of the engine's adapters (`Adapters`) this sequence decodes with (None: the base model). `images` are
    the prompt's images (`PromptImages.read` wrote out their places in it).
    """

    prompt: list[int]
    settings: SamplingSettings = SamplingSettings()
    stop_ids: frozenset[int] | None = None
    cache: list | None = None
    cache_key: str | None = None
    adapter: str | None = None
    images: PromptImages | None = None


class Sampling:
    """How one sequence draws its tokens: its sampler, random keys, repetition penalty and logit bias."""

    def __init__(self, settings: SamplingSettings, prompt: list[int], max_tokens: int):
        self.settings, self.prompt, self.max_tokens = settings, prompt, max_tokens
        self.sampler = settings.sampler()
        self.greedy = settings.greedy  # its next token is its logits' argmax alone
        self.argmax = settings.temperature == 0 and settings.repetition_penalty == 1.0  # its biased logits' argmax
        self.seed = settings.seed if settings.seed is not None or settings.temperature == 0 else random.getrandbits(32)
        self.sampled = 0  # tokens drawn, some maybe still on the device
        self.keys: mx.array | None = None  # made by the thread that steps the engine: MLX streams belong to a thread
        self.seen: mx.array | None = None  # what the repetition penalty counts
        self.bias: mx.array | None = None  # (vocab,) the logit bias, made by the thread that steps the engine

    def biased(self, logits: mx.array) -> mx.array:
        """`logits` (rows, vocab) with the settings' logit bias added."""
        if not self.settings.logit_bias:
            return logits
        return logits + self.bias_of(logits.shape[-1])

    def bias_of(self, vocab: int) -> mx.array:
        """(vocab,) the settings' logit bias, zeros without one."""
        if self.bias is None:
            self.bias = mx.zeros(vocab)
            if self.settings.logit_bias:
                ids, biases = zip(*self.settings.logit_bias)
                self.bias = self.bias.at[mx.array(ids)].add(mx.array(biases))
        return self.bias

    def next_key(self) -> mx.array | None:
        """The random key of the next token drawn (None unseeded)."""
        if self.keys is None and self.seed is not None:
            self.keys = mx.random.split(mx.random.key(self.seed), self.max_tokens)
        return self.keys[self.sampled] if self.keys is not None else None

    def sample(self, logits: mx.array, fed: mx.array) -> mx.array:
        """The next token (1,) from the logits (1, vocab), `fed` (1,) being the token just read."""
        penalty = self.settings.repetition_penalty
        if penalty != 1.0:
            self.seen = mx.concatenate([self.seen, fed]) if self.sampled else mx.array(self.prompt)
            logits = apply_repetition_penalty(logits, self.seen, penalty)
        logits = self.biased(logits)
        key = self.next_key()
        self.sampled += 1
        return self.sampler(logits, key)


@dataclass
class Speculation:
    """A sequence's speculative rounds: the model's side of each, and the tokens proposed and kept."""

    verifier: Verifier | None = None
    drafted: int = 0
    accepted: int = 0


class Generation:
    """One request inside the engine: its tokens so far, where it stands, and its parts."""

    def __init__(self, request: Request, tokenizer, context: int | None, vocab: int | None = None):
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
        self.sampling = Sampling(settings, request.prompt, self.max_tokens)
        self.text = TextStream(tokenizer, settings.stop)
        self.logprobs = Logprobs(settings.logprobs) if settings.logprobs is not None else None
        self.speculation = Speculation()
        self.matcher: Matcher | None = None  # a constrained generation's place in its grammar
        if settings.constraint is not None:
            if tokenizer is None:
                raise InvalidSettingError("a constraint needs the tokenizer; give the engine one")
            self.matcher = Matcher(settings.constraint, tokenizer, vocab or tokenizer.vocab_size)
        self.tokens: list[int] = []  # generated and read back
        self.cached_tokens = 0  # prompt tokens the prompt cache supplied
        self.finish_reason: str | None = None
        self.cancelled = False
        self.failure: Exception | None = None  # what failed in this sequence's own step (its next read ends it)
        self.cache: list | None = None  # once it has left the batch: its conversation's cache (request.cache)

    prompt = property(lambda self: self.request.prompt)
    prompt_tokens = property(lambda self: len(self.request.prompt))
    continued = property(lambda self: self.request.cache is not None, doc="whether it continues a conversation")
    sampled = property(lambda self: self.sampling.sampled, doc="tokens drawn, some maybe still on the device")
    seed = property(lambda self: self.sampling.seed)
    drafted = property(lambda self: self.speculation.drafted)
    accepted = property(lambda self: self.speculation.accepted)
    stop_string = property(lambda self: self.text.stop_string, doc="the stop string that ended it, if one did")
    reads_images = property(lambda self: self.request.images is not None, doc="whether its prompt holds images")

    @property
    def cache_ids(self) -> list[int]:
        """The ids the prompt cache knows its prompt by: its images' places keyed by their pixels."""
        images = self.request.images
        return self.request.prompt if images is None else images.keyed(self.request.prompt)

    @property
    def running(self) -> bool:
        return self.finish_reason is None and not self.cancelled

    @property
    def going_on(self) -> bool:
        """Whether it wants another step (`scheduler.Schedulable`)."""
        return self.running and self.sampled < self.max_tokens

    def sample(self, logits: mx.array, fed: mx.array) -> mx.array:
        """The next token (1,) from this generation's logits (1, vocab), `fed` (1,) being the token just read."""
        return self.sampling.sample(logits, fed)

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
        text = self.text.add(token, end, finish)
        self.finish_reason = "stop" if self.text.stop_string is not None else finish
        if self.logprobs is None:
            return Output(self, token, text, self.finish_reason)
        return Output(self, token, text, self.finish_reason, *self.logprobs.read())
