"""The models a server holds: each loaded one with its own engine, engine thread and batch (`ServedModel`), and the
holder that loads them on the first request naming them and unloads them as the policy (residency.py) says
(`Models`): least recently used first when the memory budget is full, after their keep-alive when idle, never while
a request holds them."""

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map

from ..decode import Engine
from ..decode.images import PromptImages
from ..decode.prompt import as_written, check_ids, vocab_size
from ..embedding import Embedder, reranker
from ..errors import InvalidSettingError, MinimlxError
from ..vision import ImageLimits
from .access_log import RequestRecord, current_request
from .adapters import AdapterChoice, chosen
from .answer import Answer
from .bridge import EngineBridge
from .card import ModelCard
from .catalog import Catalog, Known, path_of
from .fields import APIError, bad, sampling_settings
from .images import ImageFetcher, fetched
from .rendering import Renderer
from .residency import Residency
from .turns import ForcedCall, Turn

log = logging.getLogger("minimlx.serve")
UNBOUNDED_MAX_TOKENS = 32_768  # an answer's limit when neither the request, --max-tokens nor the context bound it
HEARTBEAT_SECONDS = 5.0  # the longest a stream stays silent (a long prefill) before a keep-alive is sent
EXPIRY_CHECK_SECONDS = 1.0  # how often idle models are looked at for a passed keep-alive


@dataclass(frozen=True)
class Serving:
    """How every model is served: `chat_template` replaces the model's own, `reasoning` splits thinking from the
    answer, `request_timeout` (seconds) ends a longer generation, `max_tokens` bounds every answer (serve's
    --max-tokens; else the room left in the context), `forced_call` is --force-tool-call and `heartbeat` the longest
    a stream stays silent; `image_urls` fetches http(s) image URLs (--allow-image-urls; None: they are refused);
    `image_limits` is what a request's pictures may be (their number, file sizes and pixels)."""

    chat_template: str | None = None
    reasoning: bool = True
    request_timeout: float | None = None
    max_tokens: int | None = None
    forced_call: ForcedCall | None = None
    heartbeat: float = HEARTBEAT_SECONDS
    image_urls: ImageFetcher | None = None
    image_limits: ImageLimits = ImageLimits()


class ServedModel:
    """One loaded model as the endpoints use it: its engine and the bridge to its thread, the renderer of its chat
    template, its card (Ollama's description), its embedder (None without a pooling) and reranker."""

    def __init__(self, engine: Engine, known: Known, serving: Serving = Serving(), embedder: Embedder | None = None):
        self.engine, self.tokenizer, self.known = engine, engine.tokenizer, known
        self.adapters = AdapterChoice(known.name, engine.adapters, any_name=True)  # the catalog checked the name
        self.serving, self.embedder = serving, embedder
        self.bridge = EngineBridge(engine, serving.request_timeout)
        model = engine.model
        self.reads_images = "vision" in model
        self.inputs = ("text", "image") if self.reads_images else ("text",)
        image_text, write_images = None, as_written
        if self.reads_images:
            image_text = self.tokenizer.decode([model.config.image_start_token])
            write_images = model.config.write_images_text
        self.renderer = Renderer(
            engine.tokenizer, serving.chat_template, serving.reasoning, serving.forced_call, image_text, write_images
        )
        capabilities = self.renderer.capabilities() + (("embedding",) if embedder is not None else ())
        capabilities += ("vision",) if self.reads_images else ()
        self.card = ModelCard.of(engine.model, known.name, str(known.path), capabilities)
        self.reranker = reranker(engine.model, self.tokenizer)

    name = property(lambda self: self.adapters.answered(), doc="the model's name, or BASE:NAME on its adapter NAME")

    def close(self) -> None:
        """End the engine's thread and let go of the weights and the prompt cache's arrays at once: an answer of this
        model that a finished response still references for a moment must not keep them in memory."""
        self.bridge.stop()
        model = self.engine.model
        model.update(tree_map(lambda a: mx.zeros((0,), a.dtype), model.parameters()))
        if self.engine.prompt_cache is not None:
            self.engine.prompt_cache.entries = []

    def render(self, turn: Turn) -> str:
        return self.renderer.render(turn)

    def count_tokens(self, turn: Turn) -> int:
        """The turn's prompt tokens, each image's places among them (as `expand_images` writes them out)."""
        ids = self.renderer.prompt_ids(self.renderer.render(turn), turn)
        model = self.engine.model
        if turn.images and model.image_processor is not None:
            limits = self.serving.image_limits
            try:
                limits.check(turn.images)
                inputs = model.image_processor(turn.images, limits.max_pixels)
            except InvalidSettingError as e:
                raise bad(turn.messages_param, str(e)) from None
            ids = model.config.expand_images(ids, inputs)
        return len(ids)

    async def start(self, turn: Turn) -> Answer:
        """Start the turn's choices: its template, its tool choice or answer grammar, its settings, its images (read
        and checked on a worker thread: decoding a picture takes a while)."""
        turn, prompt, parser, switched = self.renderer.prepare(turn)
        images = None
        if turn.images:
            limits = self.serving.image_limits
            try:
                limits.check(turn.images)  # their number before any URL among them is fetched
                pictures = await asyncio.to_thread(fetched, turn.images, self.serving.image_urls)
                prompt, images = await asyncio.to_thread(PromptImages.read, self.engine.model, prompt, pictures, limits)
            except InvalidSettingError as e:
                raise bad(turn.messages_param, str(e)) from None
        answer = await self.start_raw(prompt, turn, turn.messages_param, bounded=not switched, images=images)
        answer.parsers = [parser() for _ in answer.generations]
        return answer

    async def start_raw(
        self, prompt: list[int], turn: Turn, param: str, bounded: bool = True, images: PromptImages | None = None
    ) -> Answer:
        """Start `turn.n` generations of the token ids `prompt` (the request's field `param`, holding `images`) with
        the turn's settings; their text is content alone. Without a max_tokens the answer may use the room left in the
        context (or --max-tokens); one above that is capped, and the answer says so."""
        if turn.n > self.engine.max_batch:
            raise bad("n", f"'n' is {turn.n} but this server decodes at most {self.engine.max_batch} (--max-batch)")
        try:  # a client's ids outside the vocabulary would read past the embedding
            prompt = check_ids(prompt, vocab_size(self.engine.model))
        except InvalidSettingError as e:
            raise bad(param, f"'{param}': {e}") from None
        asked = turn.settings.get("max_tokens")
        limit = (self.serving.max_tokens if bounded else None) or self.engine.context or UNBOUNDED_MAX_TOKENS
        fields = {**turn.settings, "max_tokens": limit if asked is None else min(asked, limit)}
        settings = sampling_settings(turn.params, **fields, constraint=turn.constraint, logprobs=turn.logprobs)
        generations, queue = self.bridge.submit(
            prompt, settings, turn.n, param, turn.cache_key, chosen.get(), images=images
        )
        answer = Answer(self.bridge, self.renderer, generations, queue, self.serving.heartbeat)
        given = generations[0].max_tokens
        if asked is not None and given < asked:  # llama-server's rule: the answer is capped, and this says so
            answer.capped = (asked, given)
        record = current_request.get()
        if record is not None:
            record.answer = answer
        return answer


class Models:
    """The models of one server: `catalog` names those it may load, `load` loads one (a `ServedModel`, its engine
    not yet started), `residency` decides which stay; `preloaded` are loaded already (serve's one --model).

    A request holds its model from `hold` until its response is over (`finished`, called by the access log);
    loads happen one at a time, each on a worker thread, while the other models keep answering."""

    def __init__(
        self,
        catalog: Catalog,
        load: Callable[[Known], ServedModel],
        residency: Residency | None = None,
        preloaded: tuple[ServedModel, ...] = (),
    ):
        self.catalog, self.load, self.residency = catalog, load, residency or Residency()
        self.loaded: dict[str, ServedModel] = {}
        for served in preloaded:
            self.loaded[served.known.name] = served
            self.residency.loaded(served.known.name, served.card.size, time.monotonic())
        self.loading = asyncio.Lock()  # one load at a time
        self.changed = asyncio.Event()  # set whenever a request finishes or a model leaves: room may have been made
        self.draining = False
        self.held_back: set[str] = set()  # busy models a waiting load needs gone: their new requests wait too

    @classmethod
    def one(cls, engine: Engine, name: str, serving: Serving = Serving(), embedder: Embedder | None = None) -> "Models":
        """A server of one model, loaded: `name` is what answers report, and any name a request gives is answered."""
        known = Known(name, name, path_of(name))
        served = ServedModel(engine, known, serving, embedder)
        return cls(Catalog([known], any_name=True), lambda known: served, preloaded=(served,))

    def names(self) -> list[str]:
        """The names requests may give: every known model's, and BASE:NAME for each adapter NAME of a loaded one."""
        return [name for name, _ in self.listing()]

    def listing(self) -> list[tuple[str, tuple[str, ...]]]:
        """(name, the inputs it reads: "text", and "image" for an image-text model) of each name requests may give;
        a model not loaded yet is known by its folder's config."""
        listed = []
        for known in self.catalog.models:
            served = self.loaded.get(known.name)
            if served is None:
                listed.append((known.name, known.inputs))
            else:
                listed += [(name, served.inputs) for name in served.adapters.models()]
        return listed

    def adapted_base(self, asked):
        """The model `asked` names: BASE for BASE:NAME or NAME alone, where NAME is an adapter of the loaded model
        BASE; else `asked` as it is."""
        if isinstance(asked, str):
            base, _, name = asked.removesuffix(":latest").rpartition(":")
            for served in self.loaded.values():
                if name in served.adapters.adapters and base == served.known.name or asked in served.adapters.adapters:
                    return served.known.name
        return asked

    @asynccontextmanager
    async def lifespan(self, app):
        for served in self.loaded.values():
            served.bridge.start()
        expiring = asyncio.create_task(self.expire())
        yield
        expiring.cancel()
        for served in list(self.loaded.values()):
            served.bridge.stop()

    async def hold(self, known: Known, keep_alive: float | None = None) -> ServedModel:
        """`known`'s loaded model, loaded first if it is not (after the models that must leave for it have finished
        their requests), held by the current request until its response is over."""
        while known.name in self.held_back:  # it is to leave for a model waiting to come in: wait for the swap
            self.changed.clear()
            await self.changed.wait()
        served = self.loaded.get(known.name) or await self.bring_in(known)
        record = current_request.get()
        if record is not None:  # every HTTP request has one (the access log's)
            self.residency.began(known.name, keep_alive)
            record.held.append(known.name)
        return served

    def finished(self, record: RequestRecord) -> None:
        """A response is over: the models it held are free (one whose keep-alive is 0 leaves now)."""
        now = time.monotonic()
        for name in record.held:
            self.residency.finished(name, now)
            if name in self.loaded and self.residency.expires_at(name) <= now:
                asyncio.get_running_loop().create_task(self.unload(name))
        self.changed.set()

    async def bring_in(self, known: Known) -> ServedModel:
        async with self.loading:
            try:
                return await self.load_when_room(known)
            finally:
                if self.held_back:
                    self.held_back = set()
                    self.changed.set()

    async def load_when_room(self, known: Known) -> ServedModel:
        """Load `known` once the budget has room for it: the models the policy names leave first."""
        while known.name not in self.loaded:
            if self.draining:
                raise APIError(503, "the server is shutting down; try another", code="shutting_down")
            leaving = self.residency.room_for(known.disk_bytes)
            if leaving is None:  # the memory is held by models whose requests are running: wait for them
                self.held_back = set(self.residency.held_back(known.disk_bytes))
                self.changed.clear()
                await self.changed.wait()
                continue
            self.held_back = set(leaving)  # their new requests wait until this load is done
            for name in leaving:
                await self.unload(name)
            started = time.monotonic()
            try:
                served = await asyncio.to_thread(self.load, known)
            except MinimlxError as e:
                message = f"could not load the model '{known.name}': {e}"
                raise APIError(500, message, "model", "model_load_failed", kind="server_error") from None
            served.bridge.start()
            self.loaded[known.name] = served
            self.residency.loaded(known.name, served.card.size, time.monotonic())
            took = time.monotonic() - started
            log.info("loaded %s (%.1f MB) in %.1f s", known.name, served.card.size / 1e6, took)
        return self.loaded[known.name]

    async def unload(self, name: str) -> None:
        """Unload `name` if it is loaded and no request holds it: its engine thread ends, its memory goes back."""
        resident = self.residency.residents.get(name)
        if resident is None or resident.in_flight:
            return
        served = self.loaded.pop(name)
        self.residency.unloaded(name)
        await asyncio.to_thread(served.close)
        size = served.card.size
        del served
        gc.collect()
        mx.clear_cache()
        log.info("unloaded %s (%.1f MB)", name, size / 1e6)
        self.changed.set()

    async def expire(self) -> None:
        """Unload each idle model once its keep-alive has passed."""
        while True:
            for name in self.residency.expired(time.monotonic()):
                await self.unload(name)
            wait = self.residency.next_expiry() - time.monotonic()
            await asyncio.sleep(min(max(wait, 0.01), EXPIRY_CHECK_SECONDS))

    def drain(self, grace: float) -> None:
        """Refuse new requests and loads (503); end the running ones `grace` seconds from now."""
        self.draining = True
        for served in self.loaded.values():
            served.bridge.drain(grace)
        self.changed.set()
