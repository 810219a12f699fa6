"""A chat that keeps its KV cache between turns (`minimlx chat`)."""

import warnings
from collections.abc import Iterator, Sequence
from contextlib import closing

import mlx.nn as nn

from ..errors import InvalidSettingError
from .generate import GenerationResponse, make_cache, stream_generate
from .images import PromptImages
from .prefill import reusable, shared_start
from .prompt_cache import SavedPrompt
from .settings import NAMES, SamplingSettings, sampling_settings


class Conversation:
    """A chat whose KV cache holds the conversation so far, so each turn prefills only its new tokens.

    Every turn renders the whole conversation with the chat template, keeps the cached tokens
    that agree with it, trims the rest and feeds only what follows. A conversation that no longer
    leaves room for an answer in the model's context drops its oldest turns (the system prompt stays),
    with one warning per conversation. `kv_bits` holds the cache quantized (as `stream_generate` takes it). With a
    `prompt_cache` (`load_prompt_cache`) the conversation starts (and restarts) from its saved tokens; with
    `max_kv_size` its cache keeps that many tokens at most (the first and the latest), so that an endless chat
    stays in bounded memory.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        system: str | None = None,
        kv_bits: int | None = None,
        prompt_cache: SavedPrompt | None = None,
        max_kv_size: int | None = None,
    ):
        self.model, self.tokenizer, self.system, self.kv_bits = model, tokenizer, system, kv_bits
        self.prompt_cache, self.max_kv_size = prompt_cache, max_kv_size
        if prompt_cache is not None and max_kv_size is not None:
            raise InvalidSettingError("a saved prompt cache is not bounded by max_kv_size; drop one of them")
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.cache = make_cache(self.model, self.kv_bits, self.max_kv_size)
        self.cached_ids: list[int] = []
        if self.prompt_cache is not None:
            self.cached_ids = list(self.prompt_cache.ids)
            self.cache = self.prompt_cache.holding(len(self.cached_ids), self.cache)
        self.images: list = []  # the pictures of the conversation's messages, in order
        self.prompt = ""
        self.warned = False

    def render(self, messages: list[dict], images: bool = False) -> list[int]:
        """The prompt ids of `messages` (holding `images`: written out as the model's processor writes them); its
        text stays in `prompt` (it tells whether the answer opens thinking)."""
        self.prompt = self.tokenizer.apply_chat_template(messages)
        text = self.model.config.write_images_text(self.prompt) if images else self.prompt
        return self.tokenizer.encode(text, add_special_tokens=False)

    def keep(self, count: int) -> int:
        """Forget every cached token after the first `count` (back to fewer where a layer cannot go back there: a
        recurrent state to its latest mark before, a sliding window to none): the number kept."""
        count = reusable(self.cache, count)
        for c in self.cache:
            c.trim(c.offset - count)
        self.cached_ids = self.cached_ids[:count]
        return count

    def say(
        self, text: str, settings: SamplingSettings | None = None, images: Sequence = (), **options
    ) -> Iterator[GenerationResponse]:
        """Stream the answer to `text`; `settings` (or its fields by name) and `options` are stream_generate's.
        `images` (an image-text model's pictures: paths, bytes or Pillow images) go before the text, each at the
        model's image start token. A turn bringing a picture reads the conversation again from its start (its images'
        soft tokens are read in one first pass); the turns after it prefill only their new tokens.

        Closing the iterator early (or an interrupt) keeps the answer so far in the conversation.
        """
        settings = sampling_settings(settings, {name: options.pop(name) for name in NAMES & options.keys()})
        if images:
            if "vision" not in self.model:
                raise InvalidSettingError("this model reads text only; load an image-text model to send pictures")
            text = self.tokenizer.decode([self.model.config.image_start_token]) * len(images) + text
        pictures = self.images + list(images)
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.render(messages, bool(pictures))
        context = getattr(self.model.config, "max_positions", None)
        room = min(settings.max_tokens, context // 4) if context else 0
        first = 1 if self.system is not None else 0  # the first message that may be dropped
        while context and len(ids) + room > context and len(messages) - first > 1:
            messages = messages[:first] + messages[first + 2 :]  # the oldest exchange: a question and its answer
            ids = self.render(messages, bool(pictures))
            if not self.warned:
                warnings.warn(
                    f"the conversation no longer fits the model's context of {context} tokens: dropping its oldest "
                    "turns (the system prompt stays); /reset starts over",
                    stacklevel=2,
                )
                self.warned = True
        places = ids.count(self.model.config.image_start_token) if pictures else 0
        pictures = pictures[len(pictures) - places :] if places else []  # those of the turns kept
        written, reread = ids, False
        if pictures:  # the cached ids hold the images' places written out
            written, placed = PromptImages.read(self.model, ids, pictures)
        shared = self.keep(shared_start(self.cached_ids, written))
        if pictures and shared < placed.end:  # the cache holds not all of the images: read the prompt from its start
            shared, reread = self.keep(0), True
        prompt = ids if reread else written[shared:]
        answer, generated = [], []
        try:
            stream = stream_generate(
                self.model,
                self.tokenizer,
                prompt,
                settings=settings,
                cache=self.cache,
                kv_bits=self.kv_bits,
                images=pictures if reread else None,
                **options,
            )
            with closing(stream) as responses:
                for response in responses:
                    if not generated:
                        self.messages, self.images = messages, pictures
                    answer.append(response.text)
                    generated.append(response.token)
                    yield response
        finally:
            if generated:
                self.messages = self.messages + [{"role": "assistant", "content": "".join(answer)}]
            self.cached_ids = written + generated
            self.keep(min(len(self.cached_ids), *(c.offset for c in self.cache)))
