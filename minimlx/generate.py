"""Text generation: prefill the prompt in chunks, then decode one token at a time through the KV cache.

The decode loop is pipelined: the graph of step n+1 is built and queued (`mx.async_eval`)
before token n is read back, so the host builds the next step while the device computes, and
the only synchronisation per token is reading its id.

Nothing is `mx.compile`d: the KV cache grows by slice writes at Python-int offsets, so a compiled
step would be retraced every token, and compiling the sampler alone saved under 0.5 ms of a
60 ms SmolLM2 step on the CPU (measured), less than its tracing costs a short answer.
"""

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .core.sampling import Sampler, apply_repetition_penalty, check_settings, make_sampler
from .errors import InvalidSettingError


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


def generate_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    cache: list,
    sampler: Sampler,
    max_tokens: int,
    prefill_step: int = 512,
    repetition_penalty: float = 1.0,
    key: mx.array | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids continuing `prompt` (which continues `cache`).

    All prompt tokens but the last are prefilled in chunks of `prefill_step`, evaluating only the
    cache, so the head (vocabulary-sized) runs on one position only. When token n is yielded it has
    already been fed to the model unless it is the last one allowed.
    """
    tokens = mx.array(prompt, dtype=mx.int32)
    for start in range(0, len(prompt) - 1, prefill_step):
        model(tokens[None, start : min(start + prefill_step, len(prompt) - 1)], cache)
        mx.eval([c.state for c in cache])
    keys = mx.random.split(key, max_tokens) if key is not None else [None] * max_tokens
    seen = tokens

    def step(ids: mx.array, n: int) -> mx.array:
        nonlocal seen
        logits = model(ids[None], cache)[:, -1, :]
        if repetition_penalty != 1.0:
            seen = mx.concatenate([seen, ids]) if n else seen
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        return sampler(logits, keys[n])

    y = step(tokens[-1:], 0)
    mx.async_eval(y)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_y = step(y, n + 1)
            mx.async_eval(next_y)
        yield y.item()
        y = next_y


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


def encode_prompt(tokenizer, prompt: str | Sequence[int], chat_template: bool = True, system: str | None = None):
    """Token ids of the prompt: ids pass through; text goes through the chat template when the model has one."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if system is not None and not chat_template:
        raise InvalidSettingError("a system prompt needs the chat template; drop --no-chat-template or --system")
    if chat_template and (tokenizer.chat_template is not None or system is not None):
        system_message = [{"role": "system", "content": system}] if system is not None else []
        messages = system_message + [{"role": "user", "content": prompt}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return tokenizer.encode(prompt)


def split_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text held back because a stop string may start there, whether a stop string ended it)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    if found:
        return text[: min(found)], "", True
    held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held], text[len(text) - held :], False


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
) -> Iterator[GenerationResponse]:
    """Generate from `prompt` (text, or token ids used as they are), yielding one response per token.

    Generation ends at an end-of-sequence id (its text is not emitted), at a `stop` string (the
    text ends before it), or after `max_tokens`; the last response carries `finish_reason`.
    Pass a `cache` (from `model.make_cache()`) to continue a conversation: `prompt` then holds only
    the new tokens. The repetition penalty counts the tokens of this prompt and of the answer.
    """
    check_generation_settings(max_tokens, temperature, top_p, top_k, min_p, repetition_penalty)
    ids = encode_prompt(tokenizer, prompt, chat_template, system)
    cache = model.make_cache() if cache is None else cache
    context, used = getattr(model.config, "max_positions", None), cache[0].offset if cache else 0
    if not ids:
        raise InvalidSettingError("the prompt is empty; give some text")
    if context is not None and used + len(ids) >= context:
        raise InvalidSettingError(
            f"the prompt needs {used + len(ids)} positions but the model's context holds {context}; shorten it"
        )
    if context is not None:
        max_tokens = min(max_tokens, context - used - len(ids))
    key = None if temperature == 0 else mx.random.key(seed if seed is not None else random.getrandbits(32))
    sampler = make_sampler(temperature, top_p, top_k, min_p)
    tokens = generate_tokens(model, ids, cache, sampler, max_tokens, prefill_step, repetition_penalty, key)

    stop, eos = list(stop or []), tokenizer.eos_token_ids
    detokenizer, held = tokenizer.detokenizer(), ""
    start = time.perf_counter()
    for n, token in enumerate(tokens):
        if n == 0:
            first = time.perf_counter()
        finish = "stop" if token in eos else "length" if n + 1 == max_tokens else None
        text = held + ("" if token in eos else detokenizer.add(token))
        if finish is not None:
            text += detokenizer.finalize()
        text, held, stopped = split_at_stop(text, stop) if stop else (text, "", False)
        if finish is not None and not stopped:
            text += held
        elapsed = time.perf_counter() - first
        yield GenerationResponse(
            text=text,
            token=token,
            prompt_tokens=len(ids),
            prompt_tps=len(ids) / (first - start),
            generation_tokens=n + 1,
            generation_tps=n / elapsed if n else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if stopped else finish,
        )
        if stopped or finish is not None:
            return


def generate(model: nn.Module, tokenizer, prompt: str | Sequence[int], **settings) -> str:
    """The whole answer as one string; `settings` are those of `stream_generate`."""
    return "".join(response.text for response in stream_generate(model, tokenizer, prompt, **settings))


class Conversation:
    """A chat whose KV cache holds the conversation so far, so each turn prefills only its new tokens.

    Every turn renders the whole conversation with the chat template, keeps the cached tokens
    that agree with it, trims the rest and feeds only what follows.
    """

    def __init__(self, model: nn.Module, tokenizer, system: str | None = None):
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.cache = self.model.make_cache()
        self.cached_ids: list[int] = []

    def keep(self, count: int) -> None:
        """Forget every cached token after the first `count`."""
        for c in self.cache:
            c.trim(c.offset - count)
        self.cached_ids = self.cached_ids[:count]

    def say(self, text: str, **settings) -> Iterator[GenerationResponse]:
        """Stream the answer to `text`; `settings` are stream_generate's sampling settings.

        Closing the iterator early (or an interrupt) keeps the answer so far in the conversation.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        shared = 0
        while shared < min(len(ids) - 1, len(self.cached_ids)) and ids[shared] == self.cached_ids[shared]:
            shared += 1
        self.keep(shared)
        responses = stream_generate(self.model, self.tokenizer, ids[shared:], cache=self.cache, **settings)
        answer, generated = [], []
        try:
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
