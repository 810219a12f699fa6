"""Text generation: prompts in, text out, through the one decode engine (`engine.py`).

`stream_generate` runs a batch of one and `batch_generate` a batch of many; both hand the engine
token ids and `SamplingSettings`, and turn what it returns into text and statistics. `generate_tokens`
is the engine's raw token stream, for timing it. The engine chooses how one sequence decodes: the
compiled step where the model has one, speculative rounds with a draft model or prompt lookup.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidSettingError
from ..vision import ImageLimits
from .engine import Engine, Request
from .images import DEFAULT_LIMITS, PromptImages, start_with_images
from .prompt import check_ids, prompt_ids, vocab_size
from .prompt_cache import SavedPrompt
from .settings import SamplingSettings, sampling_settings


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
    logprob: float | None = None  # with `logprobs=k`: the token's log-probability under the model
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # the k most likely (id, logprob), best first
    cached_tokens: int = 0  # prompt tokens a saved prompt cache supplied (`prompt_tps` counts the others)


def generate_tokens(
    model: nn.Module, prompt: Sequence[int], cache: list, settings: SamplingSettings, prefill_step: int = 512
) -> Iterator[int]:
    """Yield `settings.max_tokens` sampled token ids (fewer only where the model's context ends) continuing `prompt`
    (which continues `cache`), end-of-sequence ids included: the engine running one sequence, no text."""
    check_ids(prompt, vocab_size(model))
    engine = Engine(model, max_batch=1, prefill_step=prefill_step)
    engine.submit(Request(list(prompt), settings, stop_ids=frozenset(), cache=cache))
    while engine.busy:
        for output in engine.step():
            yield output.token


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    settings: SamplingSettings | None = None,
    chat_template: bool = True,
    system: str | None = None,
    cache: list | None = None,
    prefill_step: int = 512,
    draft_model: nn.Module | None = None,
    draft_tokens: int = 3,
    prompt_lookup: int = 0,
    kv_bits: int | None = None,
    prompt_cache: SavedPrompt | None = None,
    max_kv_size: int | None = None,
    images: Sequence | None = None,
    image_limits: ImageLimits = DEFAULT_LIMITS,
    **sampling,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt` (text, or token ids used as they are), yielding one response per token.

    The sampling settings come as `settings=SamplingSettings(...)` or as its fields by name (`max_tokens=32,
    temperature=0.7, ...`). Generation ends at an end-of-sequence id (its text is not emitted), at a `stop`
    string (the text ends before it), or after `max_tokens`; the last response carries `finish_reason`.
    Pass a `cache` (from `make_cache(model)`) to continue a conversation: `prompt` then holds only
    the new tokens. The repetition penalty counts the tokens of this prompt and of the answer.

    `constraint=Constraint.json_schema(schema)` (or `.regex`, `.lark`, `.gbnf`, `.json_object`) makes the answer
    match a grammar; `logprobs=k` puts each token's log-probability and its k most likely alternatives on the
    responses; `logit_bias={id: bias}` shifts some tokens' logits.

    Speculative decoding (same tokens when greedy, same distribution when sampling): `draft_model`
    (a smaller model sharing the tokenizer) proposes `draft_tokens` tokens per step, or
    `prompt_lookup=N` proposes N tokens copied from where the text's last words occurred before.

    `kv_bits=8` (or 4) holds the keys and values quantized, in about a quarter (an eighth) of the bytes; a `cache`
    passed in keeps its own kind (make one with `make_cache(model, kv_bits)`).

    `prompt_cache=load_prompt_cache(path, model, tokenizer)` starts from a saved prompt's cache: the prompt is
    given whole, and only the tokens after the saved ones are prefilled (after the start they share, where it
    does not continue them); `cached_tokens` on the responses says how many were reused.

    `max_kv_size=N` keeps N tokens in the cache at most: the first 4 (attention sinks) and the latest others, so
    that a long text stays in bounded memory; within N tokens, the answer is the plain cache's.

    `images` (paths, bytes or Pillow images) go where the prompt names them, one per image start token of an
    image-text model (Gemma 3's `<start_of_image>`), in order; such a prompt starts a conversation (no `cache` or
    `prompt_cache`) and is prefilled in one pass. `image_limits` (`ImageLimits`) bounds their number, file sizes and
    pixels.
    """
    settings = sampling_settings(settings, sampling)
    ids = prompt_ids(model, tokenizer, prompt, chat_template, system, images=bool(images))
    engine = Engine(
        model,
        tokenizer,
        max_batch=1,
        prefill_step=prefill_step,
        draft_model=draft_model,
        draft_tokens=draft_tokens,
        prompt_lookup=prompt_lookup,
        kv_bits=kv_bits,
        max_kv_size=max_kv_size,
    )
    cached = 0
    if prompt_cache is not None:
        if cache is not None:
            raise InvalidSettingError("give a cache to continue or a prompt_cache to start from, not both")
        if max_kv_size is not None:
            raise InvalidSettingError("a saved prompt cache is not bounded by max_kv_size; drop one of them")
        cached, cache = prompt_cache.start(ids, engine.make_cache())
    if images:
        ids, cache = start_with_images(model, engine, ids, images, cache, draft_model is not None, image_limits)
    generation = engine.submit(Request(ids[len(ids) - 1 if images else cached :], settings, cache=cache))
    yield from responses(engine, generation, len(ids), cached)


def responses(engine: Engine, generation, prompt_tokens: int, cached: int) -> Iterator[GenerationResponse]:
    """Step `engine` until `generation` (its only one) ends, one response per token with the speeds so far; the
    prompt's `cached` tokens were reused, not prefilled."""
    start = time.perf_counter()
    n = 0
    try:
        while generation.running:
            for output in engine.step():
                if output.finish_reason == "error":  # alone here, its failure is the caller's to see
                    raise output.generation.failure
                n += 1
                if n == 1:
                    first = time.perf_counter()
                yield GenerationResponse(
                    text=output.text,
                    token=output.token,
                    prompt_tokens=prompt_tokens,
                    prompt_tps=(prompt_tokens - cached) / (first - start),
                    generation_tokens=n,
                    generation_tps=(n - 1) / (time.perf_counter() - first) if n > 1 else 0.0,
                    peak_memory_gb=mx.get_peak_memory() / 1e9,
                    finish_reason=output.finish_reason,
                    drafted_tokens=generation.drafted,
                    accepted_tokens=generation.accepted,
                    logprob=output.logprob,
                    top_logprobs=output.top_logprobs,
                    cached_tokens=cached,
                )
    finally:
        engine.cancel(generation)
        engine.step()  # the generation leaves the batch: a `cache` passed in now holds prompt and answer


def make_cache(model: nn.Module, kv_bits: int | None = None, max_kv_size: int | None = None) -> list:
    """A cache for one sequence of `model`, of the kind its one-sequence engine decodes over (fixed-capacity where
    the compiled step can use it, quantized with `kv_bits`, bounded to `max_kv_size` tokens)."""
    return Engine(model, max_batch=1, kv_bits=kv_bits, max_kv_size=max_kv_size).make_cache()


def generate(model: nn.Module, tokenizer, prompt: str | Sequence[int], **options) -> str:
    """The whole answer as one string; `options` are those of `stream_generate`."""
    return "".join(response.text for response in stream_generate(model, tokenizer, prompt, **options))


def batch_generate(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_batch: int = 16,
    per_prompt: Sequence[dict] | None = None,
    chat_template: bool = True,
    system: str | None = None,
    prefill_step: int = 512,
    settings: SamplingSettings | None = None,
    kv_bits: int | None = None,
    images: Sequence[Sequence | None] | None = None,
    image_limits: ImageLimits = DEFAULT_LIMITS,
    **sampling,
) -> list[str]:
    """The answer to each prompt, decoded together `max_batch` at a time, in the order of `prompts`.

    `settings` (or its fields by name, as stream_generate takes them) hold for every prompt; `per_prompt` holds one
    dict per prompt that overrides some of them for that prompt. At temperature 0 each answer has the token ids
    that `generate` gives the prompt alone (with the same `kv_bits`).

    `images` holds one list of images per prompt (None or [] for a prompt of text), as `stream_generate` takes them:
    a prompt with images is prefilled alone, in one pass, then decodes in the batch with the others.
    """
    settings = sampling_settings(settings, sampling)
    per_prompt = per_prompt if per_prompt is not None else [{}] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise InvalidSettingError(f"per_prompt holds {len(per_prompt)} dicts for {len(prompts)} prompts")
    images = images if images is not None else [None] * len(prompts)
    if len(images) != len(prompts):
        raise InvalidSettingError(f"images holds {len(images)} lists for {len(prompts)} prompts; give one per prompt")
    requests = []
    for prompt, own, pictures in zip(prompts, per_prompt, images):
        ids, placed = prompt_ids(model, tokenizer, prompt, chat_template, system, images=bool(pictures)), None
        if pictures:
            ids, placed = PromptImages.read(model, ids, pictures, image_limits)
        requests.append(Request(ids, replace(settings, **own), images=placed))
    engine = Engine(model, tokenizer, max_batch=max_batch, prefill_step=prefill_step, kv_bits=kv_bits)
    generations = [engine.submit(request) for request in requests]
    texts = {id(g): [] for g in generations}
    while engine.busy:
        for output in engine.step():
            texts[id(output.generation)].append(output.text)
    return ["".join(texts[id(g)]) for g in generations]
