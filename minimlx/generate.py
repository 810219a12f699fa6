"""Text generation: prompts in, text out, through the one decode engine (`minimlx.engine`).

`stream_generate` runs a batch of one and `batch_generate` a batch of many; both hand the engine
token ids and settings, and turn what it returns into text and statistics. `generate_tokens` is
the engine's raw token stream, for timing it.

One sequence decodes through `compiled_decoder(model)` where the model allows it: each step
replays one `mx.compile`d forward pass over fixed-capacity caches (`minimlx.compiled`). With a
draft model or prompt lookup, `stream_generate` runs the speculative loop of
`minimlx.speculative` instead of the engine.
"""

import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .checks import check_ids, check_prompt, vocab_size
from .compiled import compiled_decoder
from .core.sampling import Sampler
from .engine import Engine, Request, check_generation_settings, make_request, split_at_stop  # noqa: F401  (part of this module's API)
from .engine import Sequence as EngineSequence
from .errors import InvalidSettingError
from .speculative import Acceptance, DraftModel, PromptLookup, Verifier, speculative_tokens


@dataclass
class GenerationResponse:
    """One generated token, the text it completes (possibly ""), and the running statistics."""

    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None = None  # "stop" (end of sequence or a stop string), "length", None before the end
    drafted_tokens: int = 0  # speculative decoding: tokens proposed so far, and how many the model kept
    accepted_tokens: int = 0


def generate_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    cache: list,
    sampler: Sampler,
    max_tokens: int,
    prefill_step: int = 512,
    repetition_penalty: float = 1.0,
) -> Iterator[int]:
    """Yield `max_tokens` sampled token ids (fewer only where the model's context ends) continuing `prompt`
    (which continues `cache`), end-of-sequence ids included: the engine running one sequence, no text."""
    check_ids(prompt, vocab_size(model))
    engine = Engine(model, prefill_step=prefill_step)
    request = Request(list(prompt), max_tokens, sampler, None, repetition_penalty, stop_ids=frozenset(), cache=cache)
    engine.submit(request)
    while engine.busy:
        for output in engine.step():
            yield output.token


def encode_prompt(tokenizer, prompt: str | Sequence[int], chat_template: bool = True, system: str | None = None):
    """Token ids of the prompt: ids pass through; text goes through the chat template when the model has one."""
    if not isinstance(prompt, str):
        return list(prompt)
    if system is not None and not chat_template:
        raise InvalidSettingError("a system prompt needs the chat template; drop --no-chat-template or --system")
    if chat_template and (tokenizer.chat_template is not None or system is not None):
        system_message = [{"role": "system", "content": system}] if system is not None else []
        messages = system_message + [{"role": "user", "content": prompt}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return tokenizer.encode(prompt)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    chat_template: bool = True,
    system: str | None = None,
    cache: list | None = None,
    prefill_step: int = 512,
    draft_model: nn.Module | None = None,
    draft_tokens: int = 3,
    prompt_lookup: int = 0,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt` (text, or token ids used as they are), yielding one response per token.

    Generation ends at an end-of-sequence id (its text is not emitted), at a `stop` string (the
    text ends before it), or after `max_tokens`; the last response carries `finish_reason`.
    Pass a `cache` (from `make_cache(model)`) to continue a conversation: `prompt` then holds only
    the new tokens. The repetition penalty counts the tokens of this prompt and of the answer.

    Speculative decoding (same tokens when greedy, same distribution when sampling): `draft_model`
    (a smaller model sharing the tokenizer) proposes `draft_tokens` tokens per step, or
    `prompt_lookup=N` proposes N tokens copied from where the text's last words occurred before.
    """
    vocab = vocab_size(model)
    ids = check_ids(encode_prompt(tokenizer, check_prompt(prompt, vocab), chat_template, system), vocab)
    request = make_request(ids, max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, cache)
    decoder = compiled_decoder(model) or model
    if draft_model is not None or prompt_lookup:
        if draft_model is not None and prompt_lookup:
            raise InvalidSettingError("choose one drafter: a draft model or prompt lookup, not both")
        if repetition_penalty != 1.0:
            raise InvalidSettingError("speculative decoding does not apply a repetition penalty; drop one of them")
        drafter = (
            PromptLookup(prompt_lookup)
            if prompt_lookup
            else DraftModel(compiled_decoder(draft_model) or draft_model, draft_tokens, prefill_step)
        )
        verifier = Verifier(temperature, top_p, top_k, min_p, request.seed)
        outputs = speculative_outputs(decoder, tokenizer, request, drafter, verifier, prefill_step)
    else:
        outputs = engine_outputs(decoder, tokenizer, request, prefill_step)
    start = time.perf_counter()
    with closing(outputs):
        for n, (output, acceptance) in enumerate(outputs, 1):
            if n == 1:
                first = time.perf_counter()
            yield GenerationResponse(
                text=output.text,
                token=output.token,
                prompt_tokens=len(ids),
                prompt_tps=len(ids) / (first - start),
                generation_tokens=n,
                generation_tps=(n - 1) / (time.perf_counter() - first) if n > 1 else 0.0,
                peak_memory_gb=mx.get_peak_memory() / 1e9,
                finish_reason=output.finish_reason,
                drafted_tokens=acceptance.drafted,
                accepted_tokens=acceptance.accepted,
            )


def engine_outputs(model, tokenizer, request: Request, prefill_step: int):
    """(output, Acceptance()) per token of `request`, decoded by the engine as a batch of one."""
    engine = Engine(model, tokenizer, max_batch=1, prefill_step=prefill_step)
    sequence = engine.submit(request)
    try:
        while sequence.running:
            for output in engine.step():
                yield output, Acceptance()
    finally:
        engine.cancel(sequence)
        engine.step()  # the sequence leaves the batch: a `cache` passed in now holds prompt and answer


def speculative_outputs(model, tokenizer, request: Request, drafter, verifier: Verifier, prefill_step: int):
    """(output, acceptance so far) per token of `request`, drafted by `drafter` and checked by `verifier`."""
    sequence = EngineSequence(request, tokenizer, getattr(getattr(model, "config", None), "max_positions", None))
    cache = request.cache if request.cache is not None else model.make_cache()
    acceptance = Acceptance()
    tokens = speculative_tokens(
        model, request.prompt, cache, drafter, verifier, sequence.max_tokens, acceptance, prefill_step
    )
    for token in tokens:
        yield sequence.read(token), acceptance
        if not sequence.running:
            return


def make_cache(model: nn.Module) -> list:
    """A cache for one sequence of `model`: fixed-capacity where the compiled step can use it."""
    return (compiled_decoder(model) or model).make_cache()


def generate(model: nn.Module, tokenizer, prompt: str | Sequence[int], **settings) -> str:
    """The whole answer as one string; `settings` are those of `stream_generate`."""
    return "".join(response.text for response in stream_generate(model, tokenizer, prompt, **settings))


def batch_generate(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_batch: int = 16,
    per_prompt: Sequence[dict] | None = None,
    chat_template: bool = True,
    system: str | None = None,
    prefill_step: int = 512,
    **settings,
) -> list[str]:
    """The answer to each prompt, decoded together `max_batch` at a time, in the order of `prompts`.

    `settings` are stream_generate's sampling settings (max_tokens, temperature, top_p, top_k,
    min_p, repetition_penalty, seed, stop) for every prompt; `per_prompt` holds one dict per prompt
    that overrides them for that prompt. At temperature 0 each answer has the token ids that
    `generate` gives the prompt alone.
    """
    per_prompt = per_prompt if per_prompt is not None else [{}] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise InvalidSettingError(f"per_prompt holds {len(per_prompt)} dicts for {len(prompts)} prompts")
    vocab = vocab_size(model)
    requests = [
        make_request(
            check_ids(encode_prompt(tokenizer, check_prompt(prompt, vocab), chat_template, system), vocab),
            **{**settings, **own},
        )
        for prompt, own in zip(prompts, per_prompt)
    ]
    engine = Engine(model, tokenizer, max_batch=max_batch, prefill_step=prefill_step)
    sequences = [engine.submit(request) for request in requests]
    texts = {id(s): [] for s in sequences}
    while engine.busy:
        for output in engine.step():
            texts[id(output.sequence)].append(output.text)
    return ["".join(texts[id(s)]) for s in sequences]


class Conversation:
    """A chat whose KV cache holds the conversation so far, so each turn prefills only its new tokens.

    Every turn renders the whole conversation with the chat template, keeps the cached tokens
    that agree with it, trims the rest and feeds only what follows. A conversation that no longer
    leaves room for an answer in the model's context drops its oldest turns (the system prompt stays),
    with one warning per conversation.
    """

    def __init__(self, model: nn.Module, tokenizer, system: str | None = None):
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.cache = make_cache(self.model)
        self.cached_ids: list[int] = []
        self.warned = False

    def render(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def keep(self, count: int) -> int:
        """Forget every cached token after the first `count` (all of them where a sliding-window layer no longer
        holds those): the number kept."""
        if not all(c.keeps(count) for c in self.cache):
            count = 0
        for c in self.cache:
            c.trim(c.offset - count)
        self.cached_ids = self.cached_ids[:count]
        return count

    def say(self, text: str, **settings) -> Iterator[GenerationResponse]:
        """Stream the answer to `text`; `settings` are stream_generate's sampling settings.

        Closing the iterator early (or an interrupt) keeps the answer so far in the conversation.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.render(messages)
        context = getattr(self.model.config, "max_positions", None)
        room = min(settings.get("max_tokens", 256), context // 4) if context else 0
        first = 1 if self.system is not None else 0  # the first message that may be dropped
        while context and len(ids) + room > context and len(messages) - first > 1:
            messages = messages[:first] + messages[first + 2 :]  # the oldest exchange: a question and its answer
            ids = self.render(messages)
            if not self.warned:
                warnings.warn(
                    f"the conversation no longer fits the model's context of {context} tokens: dropping its oldest "
                    "turns (the system prompt stays); /reset starts over",
                    stacklevel=2,
                )
                self.warned = True
        shared = 0
        while shared < min(len(ids) - 1, len(self.cached_ids)) and ids[shared] == self.cached_ids[shared]:
            shared += 1
        shared = self.keep(shared)
        answer, generated = [], []
        try:
            stream = stream_generate(self.model, self.tokenizer, ids[shared:], cache=self.cache, **settings)
            with closing(stream) as responses:
                for response in responses:
                    if not generated:
                        self.messages = messages
                    answer.append(response.text)
                    generated.append(response.token)
                    yield response
        finally:
            if generated:
                self.messages = self.messages + [{"role": "assistant", "content": "".join(answer)}]
            self.cached_ids = ids + generated
            self.keep(min(len(self.cached_ids), *(c.offset for c in self.cache)))
