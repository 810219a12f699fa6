"""`minimlx serve`: OpenAI's (chat completions, completions, Responses, embeddings), Anthropic's (Messages) and
Ollama's HTTP APIs over one or several models, each with its own decode engine (Starlette on uvicorn).

A thin layer: each endpoint reads its body into a `Turn` (turns.py) and asks for the model it names (models.py loads
it, within the memory budget); that model's `Renderer` (rendering.py) renders the turn and turns a tool choice into
a grammar; its the `EngineBridge` (bridge.py) hands it to the engine's thread; the tokens come
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

from . import chat, embeddings, messages, ollama, responses
from .access_log import AccessLog, current_request, log_to_stderr
from .fields import APIError, Body
from .hangups import ClientGone
from .metrics import Metrics
from .models import Models, ServedModel
from .openapi import OPENAPI

log = logging.getLogger("minimlx.serve")
MAX_REQUEST_MB = 8  # a chat of several hundred thousand words: any longer one would not fit a model's context anyway


class Server:
    """The HTTP side: routes, the API key, body limits, errors in each API's shape, and each request's model (the
    `TurnServer` the endpoints are written against): `models` (models.py) holds the models and loads them; each
    request leaves a log line (`log_format` "text" or "json") and its counts in the metrics."""

    def __init__(
        self,
        models: Models,
        api_key: str | None = None,
        max_request_mb: float = MAX_REQUEST_MB,
        log_format: str = "text",
    ):
        self.models, self.api_key = models, api_key
        self.max_body = int(max_request_mb * 1e6)
        self.metrics = Metrics(models)
        api = [Route("/v1/models", self.list_models), *chat.routes(self), *responses.routes(self)]
        api += [*messages.routes(self), *embeddings.EmbeddingAPI(self).routes()]
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
                *ollama.OllamaAPI(self).routes(),
            ],
            exception_handlers={
                APIError: self.api_error,
                ClientGone: self.client_gone,
                Exception: self.internal_error,
                404: self.not_found,
                405: self.not_allowed,
            },
            lifespan=models.lifespan,
            middleware=[
                Middleware(
                    AccessLog, json_lines=log_format == "json", observers=(self.metrics.observe, models.finished)
                )
            ],
        )
        self.metrics.endpoints = frozenset(route.path for route in self.app.routes)

    model_name = property(lambda self: self.adapters.answered(), doc="the model's name, or BASE:NAME on adapter NAME")

    @property
    def listeners(self) -> dict:
        bridges = [served.bridge for served in self.models.loaded.values()]
        return {generation: listener for bridge in bridges for generation, listener in bridge.listeners.items()}

    async def model(self, body: Body, keep_alive: float | None = None, strict: bool = False) -> ServedModel:
        """The model `body` names, loaded (after others have made room for it) and held until the response is over;
        `keep_alive` (seconds) how long it stays once idle. `strict`: the name must be one of the models' (Ollama's
        API), even on a server of one model that otherwise answers any name."""
        name = body.get("model")
        known = self.models.catalog.named(self.models.adapted_base(name), strict)
        served = await self.models.hold(known, keep_alive)
        served.adapters.read(body)
        return served

    # ---- endpoints ----

    async def health(self, request: HTTPRequest) -> JSONResponse:
        """Up, and how many answers are being decoded and how many wait for a slot (503 while shutting down)."""
        if self.models.draining:
            return await self.api_error(request, self.shutting_down())
        engines = [served.engine for served in self.models.loaded.values()]
        running, waiting = sum(e.running for e in engines), sum(len(e.waiting) for e in engines)
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    def shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down; try another", code="shutting_down", kind="server_error")

    async def openapi(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse(OPENAPI)

    async def list_models(self, request: HTTPRequest) -> JSONResponse:
        """Every model a request may name, loaded or not, with the inputs it reads (OpenRouter's `input_modalities`:
        "text", and "image" for an image-text model)."""
        self.authorize(request)
        card = {"object": "model", "created": 0, "owned_by": "minimlx"}
        listed = [{"id": name} | card | {"input_modalities": list(inputs)} for name, inputs in self.models.listing()]
        return JSONResponse({"object": "list", "data": listed})

    async def read(self, request: HTTPRequest) -> dict:
        """The JSON body, after the API key check; 503 once the server is draining, also for a request whose body
        was still arriving when it began."""
        self.authorize(request)
        try:
            raw = await self.bounded_body(request)
            if self.models.draining:
                raise self.shutting_down()
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply to read", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        body = Body(body)
        body.get("model")  # every API's field: `model()` reads it, after the endpoint has named the fields it ignores
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
    models: Models,
    host: str = "127.0.0.1",
    port: int = 8080,
    shutdown_timeout: float = SHUTDOWN_SECONDS,
    log_format: str = "text",
    **options,
):
    """Serve `models` until SIGTERM or SIGINT, then exit cleanly; `options` are Server's (api_key, max_request_mb).
    Each request leaves one line on stderr (`log_format` "text", uvicorn's access-log style, or "json")."""
    import uvicorn

    server = Server(models, log_format=log_format, **options)
    log_to_stderr(log_format)

    class Uvicorn(uvicorn.Server):
        """uvicorn, but a signal also turns new requests away (503) and ends the running ones at the cutoff, and
        a clean shutdown ends the process with status 0 rather than re-raising the signal."""

        def handle_exit(self, sig, frame) -> None:
            if not server.models.draining:
                server.models.drain(shutdown_timeout)
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
