"""`minimlx serve`: OpenAI's (chat completions, completions, Responses) and Anthropic's (Messages) HTTP APIs over
one decode engine (Starlette on uvicorn).

A thin layer: each endpoint reads its body into a `Turn` (turns.py); the server renders it with the model's chat
template and tools, turns a tool choice into a grammar, and hands the token ids and settings to the engine; the
engine's tokens come back as `Piece`s (content, reasoning and tool-call deltas, logprobs), which each endpoint
writes in its own shapes. Sampling, grammars, batching, stop strings and the prompt cache live in `minimlx.decode`;
templates, tool-call formats and reasoning in `minimlx.text`.

One thread steps the engine while any generation runs; requests join its batch as they arrive. Each
request owns an asyncio queue, which the engine thread fills through the event loop. A streaming
client that disconnects cancels its generations, which leave the batch at the next step. A generation running
past `--request-timeout` ends there with finish_reason "length"; on SIGTERM or SIGINT the server answers new
requests 503 and gives the running ones `--shutdown-timeout` seconds to finish.
"""

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import mlx.core as mx
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..decode import Engine, Generation, Output, Request, SamplingSettings
from ..decode.grammar import Constraint
from ..errors import InvalidSettingError, MinimlxError, PromptTooLongError, QueueFullError
from ..text.replies import Delta, ReplyParser, tool_format
from . import chat, messages, responses
from .access_log import AccessLog, current_request, log_to_stderr
from .fields import APIError, Body, bad, sampling_settings
from .hangups import ClientGone
from .openapi import OPENAPI
from .turns import ForcedCall, Piece, TokenLogprob, Turn, Usage, check_tools

log = logging.getLogger("minimlx.serve")
DRAINING = object()  # put on every request's queue when the server starts draining
UNBOUNDED_MAX_TOKENS = (
    32_768  # an answer's length when neither the request, --max-tokens nor the model's context bound it
)
HEARTBEAT_SECONDS = 5.0  # the longest a stream stays silent (a long prefill) before a keep-alive is sent
GATHER_QUIET, GATHER_LIMIT = 0.002, 0.02  # seconds: see Server.gather
MAX_REQUEST_MB = 8  # a chat of several hundred thousand words: any longer one would not fit a model's context anyway


class Server:
    """The engine, its thread, and the endpoints that feed it.

    `model_name` is what responses report; with `served_model_name` given, it is also the only `model` a request
    may name (404 otherwise), else any name is answered by the one model loaded. `chat_template` replaces the
    model's own; `reasoning` splits thinking text from the answer (False keeps it in the content);
    `request_timeout` (seconds) ends a generation running longer, as its token limit would.
    """

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
        forced_call: "ForcedCall | None" = None,
        heartbeat: float = HEARTBEAT_SECONDS,
    ):
        self.engine, self.tokenizer, self.api_key = engine, engine.tokenizer, api_key
        self.model_name, self.served_model_name = served_model_name or model_name, served_model_name
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.tool_format = tool_format(self.tokenizer.chat_template)
        self.reasoning = reasoning
        self.max_body = int(max_request_mb * 1e6)
        self.request_timeout = request_timeout
        self.max_tokens = max_tokens  # the longest answer, whatever a request asks (llama-server's --n-predict)
        self.forced_call = forced_call
        self.heartbeat = heartbeat  # seconds a stream may stay silent (a long prefill) before a keep-alive goes out
        self.draining = False  # set on SIGTERM/SIGINT: new requests are answered 503
        self.cutoff: float | None = None  # then, when the running ones are ended
        # Every array the model holds, private ones too (RoPE's frequencies), evaluated here: an unevaluated
        # array belongs to the stream of the thread that made it, and the engine thread has its own.
        mx.eval([a for module in engine.model.modules() for a in module.values() if isinstance(a, mx.array)])
        self.listeners: dict[Generation, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.listening = threading.Lock()  # a generation is listened to before the engine thread can deliver to it
        # generations of answers dropped unread, cancelled by the engine thread: a finalizer runs wherever a garbage
        # collection happens, maybe inside this lock or the engine's, so it only queues them (deque.append is atomic)
        self.dropped = collections.deque()
        self.stopping = False
        api = [Route("/v1/models", self.models), *chat.routes(self), *responses.routes(self), *messages.routes(self)]
        # each /v1 path also without its prefix, as llama-server answers them, for clients given a bare base URL
        bare = [
            Route(r.path.removeprefix("/v1"), r.endpoint, methods=r.methods) for r in api if r.path.startswith("/v1/")
        ]
        self.app = Starlette(
            routes=[Route("/health", self.health), Route("/openapi.json", self.openapi), *api, *bare],
            exception_handlers={
                APIError: self.api_error,
                ClientGone: self.client_gone,
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
        if self.engine.prompt_cache is not None:
            self.engine.prompt_cache.flush()  # its folder's files written before the server says it stopped

    def run_engine(self) -> None:
        with mx.stream(mx.new_stream(mx.default_device())):  # MLX streams belong to the thread that made them
            while not self.stopping:
                self.engine.wake.wait()
                self.engine.wake.clear()
                self.gather()
                self.cancel_dropped()
                while self.engine.busy and not self.stopping:
                    self.cancel_dropped()
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
            if self.engine.compiled:  # traces made on this thread's stream must not outlive it (CompiledDecoder.forget)
                self.engine.decoder.forget()

    def gather(self) -> None:
        """Before an idle engine starts: wait while requests keep arriving (each within GATHER_QUIET seconds of the
        last, GATHER_LIMIT at most). Requests sent together reach the engine one by one, as the event loop reads and
        tokenizes each; gathered, they prefill as one group (one pass over the weights) and their first tokens come
        together, where the first alone would be prefilled while the others wait for it."""
        deadline, waiting = time.monotonic() + GATHER_LIMIT, len(self.engine.waiting)
        while waiting and time.monotonic() < deadline:
            time.sleep(GATHER_QUIET)
            if len(self.engine.waiting) == waiting:
                return
            waiting = len(self.engine.waiting)

    def deliver(self, generation: Generation, item) -> None:
        with self.listening:
            listener = self.listeners.get(generation)
        if listener is not None:
            loop, queue = listener
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def submit(
        self, prompt: list[int], settings: SamplingSettings, n: int, param: str, cache_key: str | None = None
    ) -> tuple[list[Generation], asyncio.Queue]:
        """Start `n` generations of `prompt` (the request's field `param`); their outputs come on the returned queue."""
        queue, generations = asyncio.Queue(), []
        try:
            for _ in range(n):
                with self.listening:
                    generation = self.engine.submit(Request(prompt, settings, cache_key=cache_key))
                    self.listeners[generation] = (asyncio.get_running_loop(), queue)
                generations.append(generation)
        except QueueFullError as e:
            self.cancel(generations)
            raise APIError(429, str(e), code="rate_limit_exceeded", kind="rate_limit_error") from e
        except PromptTooLongError as e:
            self.cancel(generations)
            raise APIError(400, str(e), param, "context_length_exceeded") from e
        except InvalidSettingError as e:  # a setting only the engine can check (a logit_bias id past the vocabulary)
            self.cancel(generations)
            raise bad(e.field, str(e)) from e
        return generations, queue

    def drain(self, grace: float) -> None:
        """Answer new requests 503 and end the running ones (finish_reason "length") `grace` seconds from now."""
        self.draining, self.cutoff = True, time.monotonic() + grace
        with self.listening:
            listeners = list(self.listeners.values())
        for loop, queue in listeners:
            loop.call_soon_threadsafe(queue.put_nowait, DRAINING)

    def cancel_dropped(self) -> None:
        while self.dropped:
            self.cancel(self.dropped.popleft())

    def cancel(self, generations: list[Generation]) -> None:
        for generation in generations:
            self.engine.cancel(generation)
            with self.listening:
                self.listeners.pop(generation, None)

    async def outputs(
        self, generations: list[Generation], queue: asyncio.Queue, heartbeat: float | None = None
    ) -> AsyncIterator[Output | None]:
        """Every output of `generations` until all have finished; cancels them if the consumer stops early. At
        `request_timeout` the ones still running end with finish_reason "length", as at their token limit. With a
        `heartbeat` (seconds), None comes whenever that long passed without an output (a long prefill): streams
        send a keep-alive then, so that clients and proxies do not take the silence for a dead connection."""
        running = len(generations)
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        try:
            while running:
                ends = [t for t in (deadline, self.cutoff) if t is not None]
                left = max(min(ends) - time.monotonic(), 0) if ends else None
                wait = left if heartbeat is None else heartbeat if left is None else min(left, heartbeat)
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    if left is None or wait < left:
                        yield None
                        continue
                    log.warning("a request ran past --request-timeout or --shutdown-timeout; ended")
                    for generation in generations:
                        if generation.finish_reason is None:
                            self.engine.cancel(generation)
                            yield Output(generation, -1, "", "length")
                    return
                if item is DRAINING:  # the cutoff was just set: wait again, until it
                    continue
                if isinstance(item, APIError):
                    raise item
                if item.finish_reason == "error":  # this request's own step failed; the others go on
                    failure = item.generation.failure
                    log.error("a generation failed", exc_info=failure)
                    message = f"generation failed: {type(failure).__name__}: {failure}"
                    raise APIError(500, message, code="engine_error", kind="server_error")
                running -= item.finish_reason is not None
                yield item
        finally:
            self.cancel(generations)

    # ---- running a turn ----

    def render(self, turn: Turn) -> str:
        """The prompt text of a chat turn: the template over its messages and tools. A final assistant message is
        continued (its text ends the prompt, after the generation prompt). System messages after the first message
        (Claude Code sends them mid-conversation) go to the template as they are; a template that refuses them gets
        them merged, in order, into one leading system message."""
        param = turn.messages_param
        if self.tokenizer.chat_template is None:
            message = (
                "this model has no chat template: start the server with --chat-template FILE (a Jinja chat "
                "template), or send raw text to /v1/completions"
            )
            raise APIError(400, message, param, "no_chat_template")
        messages, prefill = turn.messages, ""
        if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            if len(messages) > 1 and messages[-2]["role"] == "assistant":
                raise bad(
                    param,
                    "the messages end with two assistant messages; the last one is continued, so "
                    "send at most one at the end",
                )
            messages, prefill = messages[:-1], messages[-1]["content"]
        tools = turn.tools if turn.tool_choice != "none" else None
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, **turn.template_kwargs)
        except MinimlxError as e:
            merged = merged_system(messages)
            if merged is None:
                raise bad(param, str(e)) from None
            try:
                text = self.tokenizer.apply_chat_template(merged, tools=tools, **turn.template_kwargs)
            except MinimlxError:
                raise bad(param, str(e)) from None
        return text + prefill

    def count_tokens(self, turn: Turn) -> int:
        return len(self.tokenizer.encode(self.render(turn), add_special_tokens=False))

    async def start(self, turn: Turn) -> "Answer":
        """Start the turn's choices: its template, its tool choice or answer grammar, its settings."""
        if self.forced_call is not None:
            turn = self.forced_call.applied(turn)
        tools = check_tools(turn.tools, turn.tool_choice) if turn.tool_choice != "none" else None
        constraint, forced = turn.constraint, bool(tools) and turn.tool_choice != "auto"
        if forced:
            grammar = self.tool_format.grammar(tools, turn.tool_choice, turn.parallel_tool_calls)
            constraint = Constraint.lark(grammar)
        text = self.render(turn)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        answer = await self.start_raw(prompt, replace(turn, constraint=constraint), turn.messages_param)
        answer.parsers = [
            ReplyParser(self.tokenizer.chat_template, bool(tools), self.reasoning, text, forced=forced)
            for _ in answer.generations
        ]
        return answer

    async def start_raw(self, prompt: list[int], turn: Turn, param: str) -> "Answer":
        """Start `turn.n` generations of the token ids `prompt` (the request's field `param`) with the turn's
        settings; their text is content alone."""
        if turn.n > self.engine.max_batch:
            raise bad("n", f"'n' is {turn.n} but this server decodes at most {self.engine.max_batch} (--max-batch)")
        asked = turn.settings.get("max_tokens")
        limit = self.max_tokens or self.engine.context or UNBOUNDED_MAX_TOKENS
        fields = {**turn.settings, "max_tokens": limit if asked is None else min(asked, limit)}
        settings = sampling_settings(turn.params, **fields, constraint=turn.constraint, logprobs=turn.logprobs)
        generations, queue = self.submit(prompt, settings, turn.n, param, turn.cache_key)
        answer = Answer(self, generations, queue)
        given = generations[0].max_tokens
        if asked is not None and given < asked:  # llama-server's rule: the answer is capped, and this says so
            answer.capped = (asked, given)
        record = current_request.get()
        if record is not None:
            record.answer = answer
        return answer

    def token_logprob(self, token: int, logprob: float, top) -> TokenLogprob:
        """A token's logprob with its text and bytes, and its alternatives' (`top`: (id, logprob) pairs)."""
        text = self.tokenizer.decode([token])
        alternatives = [(self.tokenizer.decode([t]), lp) for t, lp in top]
        return TokenLogprob(text, logprob, list(text.encode()), [(t, lp, list(t.encode())) for t, lp in alternatives])

    # ---- endpoints ----

    async def health(self, request: HTTPRequest) -> JSONResponse:
        """Up, and how many answers are being decoded and how many wait for a slot (503 while shutting down)."""
        if self.draining:
            return await self.api_error(request, self.shutting_down())
        return JSONResponse({"status": "ok", "running": self.engine.running, "waiting": len(self.engine.waiting)})

    def shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down; try another", code="shutting_down", kind="server_error")

    async def openapi(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse(OPENAPI)

    async def models(self, request: HTTPRequest) -> JSONResponse:
        self.authorize(request)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "minimlx"}
        return JSONResponse({"object": "list", "data": [card]})

    async def read(self, request: HTTPRequest) -> dict:
        """The JSON body, after the API key check and the model name check; 503 once the server is draining, also
        for a request whose body was still arriving when it began."""
        self.authorize(request)
        try:
            raw = await self.bounded_body(request)
            if self.draining:
                raise self.shutting_down()
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e
        except RecursionError:
            raise APIError(400, "the body's JSON is nested too deeply to read", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        body = Body(body)
        model = body.get("model")
        if self.served_model_name is not None and model is not None and model != self.served_model_name:
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
        """The error in the shape of the API asked: Anthropic's under /v1/messages, OpenAI's elsewhere."""
        record = current_request.get()
        if record is not None:
            record.error = error.message
        if request.url.path.removeprefix("/v1").startswith("/messages"):
            return JSONResponse(messages.error_body(error), status_code=error.status)
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


def merged_system(messages: list[dict]) -> list[dict] | None:
    """`messages` with every system message joined, in order, into one leading system message; None when there
    is no system message after the first message (nothing to merge)."""
    if not any(m["role"] == "system" for m in messages[1:]):
        return None
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": system}] if system else []) + rest


CAPPED_HEADER = "x-minimlx-max-tokens"  # the answer's token limit, sent when it is below what the request asked


class Answer:
    """The running choices of one turn: the engine's outputs as Pieces (deltas, logprobs, finish reasons)."""

    def __init__(self, server: Server, generations: list[Generation], queue: asyncio.Queue):
        self.server, self.generations, self.queue = server, generations, queue
        # an answer dropped unread (its response never sent: the client left first) stops its generations
        weakref.finalize(self, server.dropped.append, generations)
        self.index = {generation: i for i, generation in enumerate(generations)}
        self.parsers: list[ReplyParser] | None = None  # a chat's; a raw prompt's text is content alone
        self.called = [False] * len(generations)
        self.capped: tuple[int, int] | None = None  # (max_tokens asked, max_tokens given) when the room left capped it
        self.first_output_at: float | None = None  # time.monotonic() of the first token out

    @property
    def prompt_tokens(self) -> int:
        return self.generations[0].prompt_tokens

    def headers(self, body: Body) -> dict[str, str]:
        """The response's headers: the request's ignored fields and the cap on the answer's length, if any."""
        headers = body.headers()
        if self.capped is not None:
            headers[CAPPED_HEADER] = f"{self.capped[1]}"
        return headers

    async def pieces(self, heartbeat: bool = False) -> AsyncIterator[Piece | None]:
        """The answer's pieces; with `heartbeat`, None too whenever the server's heartbeat passes without one (a
        stream sends its keep-alive then)."""
        every = self.server.heartbeat if heartbeat else None
        async for output in self.server.outputs(self.generations, self.queue, every):
            if output is None:
                yield None
                continue
            if self.first_output_at is None:
                self.first_output_at = time.monotonic()
            yield self.piece(output)

    def piece(self, output: Output) -> Piece:
        i, generation = self.index[output.generation], output.generation
        if self.parsers is None:
            deltas = [Delta("content", output.text)] if output.text else []
        else:
            deltas = self.parsers[i].feed(output.text) if output.text else []
            if output.finish_reason is not None:
                deltas += self.parsers[i].close()
        self.called[i] |= any(d.kind == "tool_call" for d in deltas)
        finish = "tool_calls" if output.finish_reason == "stop" and self.called[i] else output.finish_reason
        logprob = None
        if output.logprob is not None and output.token not in generation.stop_ids:
            logprob = self.server.token_logprob(output.token, output.logprob, output.top_logprobs)
        return Piece(i, deltas, logprob, finish, generation.stop_string if finish else None)

    def usage(self) -> Usage:
        def answered(g: Generation) -> int:  # the stop token ending an answer is not part of it
            return len(g.tokens) - (bool(g.tokens) and g.tokens[-1] in g.stop_ids)

        completion = sum(answered(g) for g in self.generations)
        return Usage(self.prompt_tokens, completion, self.generations[0].cached_tokens)


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

    server = Server(engine, model_name, **options)
    app = AccessLog(server.app, json_lines=log_format == "json")
    log_to_stderr(log_format)

    class Uvicorn(uvicorn.Server):
        """uvicorn, but a signal also turns new requests away (503) and ends the running ones at the cutoff, and
        a clean shutdown ends the process with status 0 rather than re-raising the signal."""

        def handle_exit(self, sig, frame) -> None:
            if not server.draining:
                server.drain(shutdown_timeout)
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
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=shutdown_timeout + 2,  # past the cutoff: for the ended streams to be written
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    Uvicorn(config).run()
