"""`minimlx serve`: OpenAI's (chat completions, completions, Responses, embeddings), Anthropic's (Messages) and
Ollama's HTTP APIs over one decode engine (Starlette on uvicorn).

A thin layer: each endpoint reads its body into a `Turn` (turns.py); the `Renderer` (rendering.py) renders it and
turns a tool choice into a grammar; the `EngineBridge` (bridge.py) hands it to the engine's thread; the tokens come
back as an `Answer`'s `Piece`s (answer.py), which each endpoint writes in its own shapes. On SIGTERM or SIGINT the
server answers new requests 503 and gives the running ones `--shutdown-timeout` seconds to finish.
"""

import contextlib
import hmac
import json
import logging
import signal

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..decode import Engine
from ..embedding import Embedder, reranker
from . import chat, embeddings, messages, ollama, responses
from .access_log import AccessLog, current_request, log_to_stderr
from .adapters import AdapterChoice, chosen
from .answer import Answer
from .bridge import EngineBridge
from .fields import APIError, Body, bad, sampling_settings
from .hangups import ClientGone
from .metrics import Metrics
from .openapi import OPENAPI
from .rendering import Renderer
from .turns import ForcedCall, Turn

log = logging.getLogger("minimlx.serve")
UNBOUNDED_MAX_TOKENS = 32_768  # an answer's limit when neither the request, --max-tokens nor the context bound it
HEARTBEAT_SECONDS = 5.0  # the longest a stream stays silent (a long prefill) before a keep-alive is sent
MAX_REQUEST_MB = 8  # a chat of several hundred thousand words: any longer one would not fit a model's context anyway


class Server:
    """The HTTP side: routes, the API key, body limits, errors in each API's shape; turns started through the
    renderer and the engine bridge (the `TurnServer` the endpoints are written against).

    `model_name` is what responses report (BASE:NAME for a request on the engine's adapter NAME); with
    `served_model_name` given, it is also the only `model` a request may name (404 otherwise), else any name is
    answered by the one model loaded. `max_tokens` bounds every answer (serve's --max-tokens; else the room left in
    the context); `heartbeat` is the longest a stream stays silent; each request leaves a log line (`log_format`
    "text" or "json") and its counts in the metrics; `embedder` (the model with a pooling) answers /v1/embeddings."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        api_key: str | None = None,
        max_request_mb: float = MAX_REQUEST_MB,
        served_model_name: str | None = None,
        chat_template: str | None = None,
        reasoning: bool = True,
        request_timeout: float | None = None,
        max_tokens: int | None = None,
        forced_call: ForcedCall | None = None,
        heartbeat: float = HEARTBEAT_SECONDS,
        log_format: str = "text",
        embedder: Embedder | None = None,
    ):
        self.engine, self.tokenizer, self.api_key = engine, engine.tokenizer, api_key
        self.served_model_name = served_model_name
        self.bridge = EngineBridge(engine, request_timeout)
        self.adapters = AdapterChoice(served_model_name or model_name, engine.adapters, served_model_name is None)
        self.renderer = Renderer(engine.tokenizer, chat_template, reasoning, forced_call)
        self.max_body = int(max_request_mb * 1e6)
        self.max_tokens, self.heartbeat = max_tokens, heartbeat
        capabilities = self.renderer.capabilities() + (("embedding",) if embedder is not None else ())
        self.card = ollama.ModelCard.of(engine.model, self.model_name, model_name, capabilities)
        self.metrics = Metrics(engine, self.model_name, self.card.size)
        api = [Route("/v1/models", self.models), *chat.routes(self), *responses.routes(self), *messages.routes(self)]
        api += embeddings.EmbeddingAPI(
            self, self.bridge, embedder, reranker(engine.model, self.tokenizer), engine.context
        ).routes()
        # each /v1 path also without its prefix, as llama-server answers them, for clients given a bare base URL
        bare = [
            Route(r.path.removeprefix("/v1"), r.endpoint, methods=r.methods) for r in api if r.path.startswith("/v1/")
        ]
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/openapi.json", self.openapi),
                Route("/metrics", self.metrics.endpoint),
                *api,
                *bare,
                *ollama.OllamaAPI(self, self.card).routes(),
            ],
            exception_handlers={
                APIError: self.api_error,
                ClientGone: self.client_gone,
                Exception: self.internal_error,
                404: self.not_found,
                405: self.not_allowed,
            },
            lifespan=self.bridge.lifespan,
            middleware=[Middleware(AccessLog, json_lines=log_format == "json", observers=(self.metrics.observe,))],
        )
        self.metrics.endpoints = frozenset(route.path for route in self.app.routes)

    model_name = property(lambda self: self.adapters.answered(), doc="the model's name, or BASE:NAME on adapter NAME")

    @property
    def listeners(self) -> dict:
        return self.bridge.listeners

    # ---- running a turn ----

    def render(self, turn: Turn) -> str:
        return self.renderer.render(turn)

    def count_tokens(self, turn: Turn) -> int:
        return self.renderer.count_tokens(turn)

    async def start(self, turn: Turn) -> Answer:
        """Start the turn's choices: its template, its tool choice or answer grammar, its settings."""
        turn, prompt, parser, switched = self.renderer.prepare(turn)
        answer = await self.start_raw(prompt, turn, turn.messages_param, bounded=not switched)
        answer.parsers = [parser() for _ in answer.generations]
        return answer

    async def start_raw(self, prompt: list[int], turn: Turn, param: str, bounded: bool = True) -> Answer:
        """Start `turn.n` generations of the token ids `prompt` (the request's field `param`) with the turn's
        settings; their text is content alone. Without a max_tokens the answer may use the room left in the
        context (or --max-tokens); one above that is capped, and the answer says so."""
        if turn.n > self.engine.max_batch:
            raise bad("n", f"'n' is {turn.n} but this server decodes at most {self.engine.max_batch} (--max-batch)")
        asked = turn.settings.get("max_tokens")
        limit = (self.max_tokens if bounded else None) or self.engine.context or UNBOUNDED_MAX_TOKENS
        fields = {**turn.settings, "max_tokens": limit if asked is None else min(asked, limit)}
        settings = sampling_settings(turn.params, **fields, constraint=turn.constraint, logprobs=turn.logprobs)
        generations, queue = self.bridge.submit(prompt, settings, turn.n, param, turn.cache_key, chosen.get())
        answer = Answer(self.bridge, self.renderer, generations, queue, self.heartbeat)
        given = generations[0].max_tokens
        if asked is not None and given < asked:  # llama-server's rule: the answer is capped, and this says so
            answer.capped = (asked, given)
        record = current_request.get()
        if record is not None:
            record.answer = answer
        return answer

    # ---- endpoints ----

    async def health(self, request: HTTPRequest) -> JSONResponse:
        """Up, and how many answers are being decoded and how many wait for a slot (503 while shutting down)."""
        if self.bridge.draining:
            return await self.api_error(request, self.shutting_down())
        return JSONResponse({"status": "ok", "running": self.engine.running, "waiting": len(self.engine.waiting)})

    def shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down; try another", code="shutting_down", kind="server_error")

    async def openapi(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse(OPENAPI)

    async def models(self, request: HTTPRequest) -> JSONResponse:
        self.authorize(request)
        cards = [{"id": m, "object": "model", "created": 0, "owned_by": "minimlx"} for m in self.adapters.models()]
        return JSONResponse({"object": "list", "data": cards})

    async def read(self, request: HTTPRequest) -> dict:
        """The JSON body, after the API key check and the model name check; 503 once the server is draining, also
        for a request whose body was still arriving when it began."""
        self.authorize(request)
        try:
            raw = await self.bounded_body(request)
            if self.bridge.draining:
                raise self.shutting_down()
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply to read", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        body = Body(body)
        model, adapted = body.get("model"), self.adapters.read(body)
        named = model if not isinstance(model, str) else model.removesuffix(":latest")  # Ollama's clients add a tag
        if self.served_model_name not in (None, named) and model is not None and not adapted:
            message = f"the model '{model}' is not served here; this server answers to '{self.served_model_name}'"
            raise APIError(404, message, "model", "model_not_found", kind="not_found_error")
        return body

    async def bounded_body(self, request: HTTPRequest) -> bytes:
        """The request's bytes, refused (413) as soon as they are known to pass `--max-request-mb`: from the
        Content-Length header before any is read, else while they arrive."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise self.too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise self.too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def too_large(self) -> APIError:
        message = f"the body is larger than {self.max_body / 1e6:g} MB, the most this server reads (--max-request-mb)"
        return APIError(413, message, code="request_too_large")

    def authorize(self, request: HTTPRequest) -> None:
        """The API key as OpenAI clients send it (Authorization: Bearer KEY) or Anthropic's (x-api-key: KEY)."""
        headers = request.headers
        given = [headers.get("x-api-key", ""), headers.get("authorization", "").removeprefix("Bearer ")]
        # compared in constant time, both of them, so the time taken tells nothing about the key
        if self.api_key is not None and not sum(hmac.compare_digest(k.encode(), self.api_key.encode()) for k in given):
            message = "missing or wrong API key; send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
            raise APIError(401, message, code="invalid_api_key", kind="authentication_error")

    async def api_error(self, request: HTTPRequest, error: APIError) -> JSONResponse:
        """The error in the API's shape: Anthropic's under /v1/messages, Ollama's under /api, else OpenAI's."""
        record = current_request.get()
        if record is not None:
            record.error = error.message
        if request.url.path.removeprefix("/v1").startswith("/messages"):
            return JSONResponse(messages.error_body(error), status_code=error.status)
        if request.url.path.startswith("/api/"):
            return JSONResponse(ollama.error_body(error), status_code=error.status)
        return error.response()

    async def internal_error(self, request: HTTPRequest, error: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=error)
        kind = type(error).__name__
        return await self.api_error(
            request, APIError(500, f"internal error: {kind}", code="internal_error", kind="server_error")
        )

    async def client_gone(self, request: HTTPRequest, error: ClientGone) -> Response:
        """Nobody reads this answer: its generations are cancelled; 499 is what the log line says (nginx's code)."""
        record = current_request.get()
        if record is not None:
            record.error = str(error)
        return Response(status_code=499)

    async def not_found(self, request: HTTPRequest, error: Exception) -> JSONResponse:
        error = APIError(404, f"no such endpoint: {request.url.path}", code="not_found", kind="not_found_error")
        return await self.api_error(request, error)

    async def not_allowed(self, request: HTTPRequest, error: Exception) -> JSONResponse:
        message = f"{request.method} is not allowed on {request.url.path}"
        return await self.api_error(request, APIError(405, message, code="method_not_allowed"))


# Idle keep-alive connections stay open longer than HTTP clients keep them pooled (httpx 5 s, aiohttp 15 s):
# at uvicorn's default of 5 s a client could send its next request on a socket the server was closing at
# that moment, and get "Server disconnected without sending a response".
KEEP_ALIVE_SECONDS = 30
SHUTDOWN_SECONDS = 5  # what a stream still running at SIGTERM gets to finish, before it is cut


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    shutdown_timeout: float = SHUTDOWN_SECONDS,
    log_format: str = "text",
    **options,
):
    """Serve until SIGTERM or SIGINT, then exit cleanly; `options` are Server's (api_key, max_request_mb, ...).
    Each request leaves one line on stderr (`log_format` "text", uvicorn's access-log style, or "json")."""
    import uvicorn

    server = Server(engine, model_name, log_format=log_format, **options)
    log_to_stderr(log_format)

    class Uvicorn(uvicorn.Server):
        """uvicorn, but a signal also turns new requests away (503) and ends the running ones at the cutoff, and
        a clean shutdown ends the process with status 0 rather than re-raising the signal."""

        def handle_exit(self, sig, frame) -> None:
            if not server.bridge.draining:
                server.bridge.drain(shutdown_timeout)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            handlers = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        server.app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=shutdown_timeout + 2,  # past the cutoff: for the ended streams to be written
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    Uvicorn(config).run()
