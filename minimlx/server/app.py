"""`minimlx serve`: OpenAI-compatible HTTP endpoints over one decode engine (Starlette on uvicorn).

A thin layer: it checks each request, renders chat messages with the model's template, hands
the token ids and settings to the engine, and streams back what the engine returns. Sampling,
batching, stop strings and the prompt cache all live in `minimlx.decode`.

One thread steps the engine while any generation runs; requests join its batch as they arrive. Each
request owns an asyncio queue, which the engine thread fills through the event loop. A streaming
client that disconnects cancels its generations, which leave the batch at the next step.
"""

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import mlx.core as mx
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..decode import Engine, Generation, Output, Request, SamplingSettings
from ..errors import MinimlxError, PromptTooLongError, QueueFullError
from .fields import APIError, bad, chat_messages, flag, integer, number, sampling_settings, stop_strings

log = logging.getLogger("minimlx.serve")
DEFAULT_MAX_TOKENS = 512
MAX_REQUEST_MB = 8  # a chat of several hundred thousand words: any longer one would not fit a model's context anyway


class Server:
    """The engine, its thread, and the endpoints that feed it."""

    def __init__(
        self, engine: Engine, model_name: str, api_key: str | None = None, max_request_mb: float = MAX_REQUEST_MB
    ):
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, engine.tokenizer, model_name, api_key
        self.max_body = int(max_request_mb * 1e6)
        # Every array the model holds, private ones too (RoPE's frequencies), evaluated here: an unevaluated
        # array belongs to the stream of the thread that made it, and the engine thread has its own.
        mx.eval([a for module in engine.model.modules() for a in module.values() if isinstance(a, mx.array)])
        self.listeners: dict[Generation, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.listening = threading.Lock()  # a generation is listened to before the engine thread can deliver to it
        self.stopping = False
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ],
            exception_handlers={
                APIError: self.api_error,
                Exception: self.internal_error,
                404: self.not_found,
                405: self.not_allowed,
            },
            lifespan=self.lifespan,
        )

    # ---- the engine thread ----

    @asynccontextmanager
    async def lifespan(self, app):
        thread = threading.Thread(target=self.run_engine, name="minimlx-engine", daemon=True)
        thread.start()
        yield
        self.stopping = True
        self.engine.wake.set()
        thread.join(timeout=10)

    def run_engine(self) -> None:
        with mx.stream(mx.new_stream(mx.default_device())):  # MLX streams belong to the thread that made them
            while not self.stopping:
                self.engine.wake.wait()
                self.engine.wake.clear()
                while self.engine.busy and not self.stopping:
                    try:
                        outputs = self.engine.step()
                    except Exception as e:  # a bug: fail the requests in flight, keep serving the next ones
                        log.exception("engine step failed")
                        self.engine.clear()
                        outputs = []
                        failure = APIError(500, f"generation failed: {e}", code="engine_error", kind="server_error")
                        for generation in list(self.listeners):
                            self.deliver(generation, failure)
                    for output in outputs:
                        self.deliver(output.generation, output)
                mx.clear_cache()  # idle: MLX's freed buffers go back to the system, so memory stays flat

    def deliver(self, generation: Generation, item) -> None:
        with self.listening:
            listener = self.listeners.get(generation)
        if listener is not None:
            loop, queue = listener
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def submit(
        self, prompt: list[int], settings: SamplingSettings, n: int, param: str
    ) -> tuple[list[Generation], asyncio.Queue]:
        """Start `n` generations of `prompt` (the request's field `param`); their outputs come on the returned queue."""
        queue, generations = asyncio.Queue(), []
        try:
            for _ in range(n):
                with self.listening:
                    generation = self.engine.submit(Request(prompt, settings))
                    self.listeners[generation] = (asyncio.get_running_loop(), queue)
                generations.append(generation)
        except QueueFullError as e:
            self.cancel(generations)
            raise APIError(429, str(e), code="rate_limit_exceeded", kind="rate_limit_error") from e
        except PromptTooLongError as e:
            self.cancel(generations)
            raise APIError(400, str(e), param, "context_length_exceeded") from e
        except MinimlxError as e:
            self.cancel(generations)
            raise APIError(400, str(e), code="invalid_value") from e
        return generations, queue

    def cancel(self, generations: list[Generation]) -> None:
        for generation in generations:
            self.engine.cancel(generation)
            self.listeners.pop(generation, None)

    async def outputs(self, generations: list[Generation], queue: asyncio.Queue) -> AsyncIterator[Output]:
        """Every output of `generations` until all have finished; cancels them if the consumer stops early."""
        running = len(generations)
        try:
            while running:
                item = await queue.get()
                if isinstance(item, APIError):
                    raise item
                running -= item.finish_reason is not None
                yield item
        finally:
            self.cancel(generations)

    # ---- endpoints ----

    async def health(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(self, request: HTTPRequest) -> JSONResponse:
        self.authorize(request)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "minimlx"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: HTTPRequest):
        body = await self.read(request)
        messages = chat_messages(body)
        if self.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages", "no_chat_template")
        prompt = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return await self.complete(request, body, prompt, chat=True)

    async def completions(self, request: HTTPRequest):
        body = await self.read(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            prompt = self.tokenizer.encode(prompt)
        elif not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
            raise bad("prompt", "'prompt' must be a non-empty string or a list of token ids")
        return await self.complete(request, body, prompt, chat=False)

    async def complete(self, request: HTTPRequest, body: dict, prompt: list[int], chat: bool):
        max_tokens = integer(body, "max_completion_tokens", None) if chat else None
        max_tokens = integer(body, "max_tokens", DEFAULT_MAX_TOKENS) if max_tokens is None else max_tokens
        temperature = number(body, "temperature", 1.0)
        if temperature > 2:  # OpenAI's range, which clients are written against
            raise bad("temperature", f"'temperature' must be at most 2, got {temperature}")
        seed = integer(body, "seed", None)  # OpenAI takes any integer
        settings = sampling_settings(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=number(body, "top_p", 1.0),
            seed=seed % 2**32 if seed is not None else None,
            stop=stop_strings(body),
        )
        n = integer(body, "n", 1)
        if n < 1:
            raise bad("n", f"'n' must be at least 1, got {n}")
        stream = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("stream_options", "'stream_options' must be an object")
        include_usage = flag(options, "include_usage")
        generations, queue = self.submit(prompt, settings, n, "messages" if chat else "prompt")
        reply = Reply(self.model_name, chat, generations)
        if stream:
            events = reply.stream(self.outputs(generations, queue), include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        async for output in self.outputs(generations, queue):
            reply.add(output)
        return JSONResponse(reply.whole())

    async def read(self, request: HTTPRequest) -> dict:
        """The JSON body, after the API key check and the model name check."""
        self.authorize(request)
        try:
            body = json.loads(await self.bounded_body(request))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply to read", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model '{model}' is not loaded; this server runs '{self.model_name}'",
                "model",
                "model_not_found",
            )
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
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            message = "missing or wrong API key; send it as 'Authorization: Bearer KEY'"
            raise APIError(401, message, code="invalid_api_key")

    async def api_error(self, request: HTTPRequest, error: APIError) -> JSONResponse:
        return error.response()

    async def internal_error(self, request: HTTPRequest, error: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=error)
        error = APIError(500, f"internal error: {type(error).__name__}", code="internal_error", kind="server_error")
        return error.response()

    async def not_found(self, request: HTTPRequest, error: Exception) -> JSONResponse:
        return APIError(404, f"no such endpoint: {request.url.path}", code="not_found").response()

    async def not_allowed(self, request: HTTPRequest, error: Exception) -> JSONResponse:
        message = f"{request.method} is not allowed on {request.url.path}"
        return APIError(405, message, code="method_not_allowed").response()


class Reply:
    """The answer to one completion request, in the OpenAI shapes: whole, or as server-sent events."""

    def __init__(self, model_name: str, chat: bool, generations: list[Generation]):
        self.model_name, self.chat, self.generations = model_name, chat, generations
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.index = {generation: i for i, generation in enumerate(generations)}
        self.texts: list[list[str]] = [[] for _ in generations]
        self.finish: list[str | None] = [None] * len(generations)

    def add(self, output: Output) -> None:
        i = self.index[output.generation]
        self.texts[i].append(output.text)
        self.finish[i] = output.finish_reason

    def usage(self) -> dict:
        prompt = self.generations[0].prompt_tokens
        completion = sum(len(s.tokens) - (bool(s.tokens) and s.tokens[-1] in s.stop_ids) for s in self.generations)
        cached = self.generations[0].cached_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}

    def choice(self, i: int, text: str, finish: str | None, chunk: bool) -> dict:
        if not self.chat:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        content = {"delta": {"content": text}} if chunk else {"message": {"role": "assistant", "content": text}}
        return {"index": i, **content, "logprobs": None, "finish_reason": finish}

    def whole(self) -> dict:
        choices = [self.choice(i, "".join(t), f, chunk=False) for i, (t, f) in enumerate(zip(self.texts, self.finish))]
        return {**self.envelope(choices, chunk=False), "usage": self.usage()}

    async def stream(self, outputs: AsyncIterator[Output], include_usage: bool) -> AsyncIterator[str]:
        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        if self.chat:
            role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            first = [{"index": i, **role} for i in range(len(self.generations))]
            yield event(self.envelope(first, chunk=True))
        try:
            async for output in outputs:
                self.add(output)
                if output.text or output.finish_reason:
                    choice = self.choice(self.index[output.generation], output.text, output.finish_reason, chunk=True)
                    yield event(self.envelope([choice], chunk=True))
        except APIError as e:
            yield event({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
        if include_usage:
            yield event({**self.envelope([], chunk=True), "usage": self.usage()})
        yield "data: [DONE]\n\n"


# Idle keep-alive connections stay open longer than HTTP clients keep them pooled (httpx 5 s, aiohttp 15 s):
# at uvicorn's default of 5 s a client could send its next request on a socket the server was closing at
# that moment, and get "Server disconnected without sending a response".
KEEP_ALIVE_SECONDS = 30


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_request_mb: float = MAX_REQUEST_MB,
):
    """Serve until interrupted."""
    import uvicorn

    app = Server(engine, model_name, api_key, max_request_mb).app
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=3,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
