"""Ollama's API (`/api/*`): what JetBrains, Zed, n8n, the VS Code Ollama extension, LangChain's ChatOllama and the
official `ollama` client speak.

A translation, like the OpenAI and Anthropic endpoints: `/api/chat` and `/api/generate` read their body into a
`Turn` (Ollama's `options` into sampling settings, `format` into a grammar, `think` into the template's variables)
and write the `Answer`'s pieces as Ollama's NDJSON stream (or one object with `stream: false`); `/api/tags`,
`/api/show` and `/api/ps` describe the models (each loaded one by its `ModelCard`, card.py), `keep_alive` sets how
long a model stays loaded once idle; `/api/pull` downloads from the Hugging Face Hub (minimlx/io/hub.py). Errors
are Ollama's `{"error": "..."}`.
"""

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import mlx.core as mx
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..decode.grammar import Constraint
from ..errors import InvalidSettingError, MinimlxError
from ..io import hub
from .fields import APIError, Body, bad, checked_schema, flag, ignore_unread, optional, text_content
from .hangups import until_disconnected
from .images import ollama_images
from .residency import FOREVER, Resident, seconds
from .turns import Turn

if TYPE_CHECKING:
    from .answer import Answer
    from .catalog import Known
    from .models import ServedModel
    from .protocol import TurnServer

VERSION = "0.12.0"  # the Ollama API version whose shapes these are (clients check it is recent enough)
NDJSON = "application/x-ndjson"
# Ollama's options -> the Turn's sampling settings (num_predict -1: no bound but the context's)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty"}  # fmt: skip
OLLAMA_TEMPERATURE = 0.8  # Ollama's default, which its clients expect when they send none


class OllamaAPI:
    """The /api/* endpoints over a server (`TurnServer`) and its models."""

    def __init__(self, server: "TurnServer"):
        self.server, self.models = server, server.models

    async def model_of(self, body: Body) -> "ServedModel":
        return await held_model(self.server, body)

    async def chat(self, request: HTTPRequest):
        body = await self.server.read(request)
        images = []
        turn = Turn(chat_messages(body.get("messages"), images), tools=tools(body), images=images)
        return await self.answer(request, body, turn, "message")

    async def generate(self, request: HTTPRequest):
        """A completion of `prompt`; without one, Ollama's way to load a model (or, with keep_alive 0, unload it)."""
        body = await self.server.read(request)
        prompt = optional(body, "prompt", str, "a string") or ""
        images = []
        places = ollama_images(body.get("images") or [], "images", images)
        if not prompt:
            model = await self.model_of(body)
            unloading = self.models.residency.residents[model.known.name].keep_alive == 0
            now = datetime.now(timezone.utc).isoformat()
            done = {"model": model.card.name, "created_at": now, "response": "", "done": True}
            return JSONResponse(done | {"done_reason": "unload" if unloading else "load"})
        system = optional(body, "system", str, "a string")
        user = {"role": "user", "content": places + prompt}
        turn = Turn(([{"role": "system", "content": system}] if system else []) + [user], images=images)
        if images and flag(body, "raw"):
            raise bad("raw", "a raw prompt takes no images; send the images without 'raw'")
        return await self.answer(request, body, turn, "response")

    async def answer(self, request: HTTPRequest, body: Body, turn: Turn, kind: str):
        turn.settings, turn.template_kwargs = sampling(body), thinking(body.get("think"))
        turn.constraint = answer_format(body.get("format"))
        stream = body.get("stream") is None or flag(body, "stream")
        raw = kind == "response" and flag(body, "raw")
        model = await self.model_of(body)
        ignore_unread(body, "ollama")
        if raw:
            prompt = model.tokenizer.encode(turn.messages[-1]["content"])
            started = await model.start_raw(prompt, turn, "prompt")
        else:
            started = await model.start(turn)
        reply = Reply(model.card.name, kind, started)
        if stream:
            return StreamingResponse(reply.lines(), media_type=NDJSON, headers=started.headers(body))
        whole = await until_disconnected(request, reply.whole())
        return JSONResponse(whole, headers=started.headers(body))

    async def tags(self, request: HTTPRequest):
        """Every model a request may name: a loaded one as its card says, the others as their files do."""
        loaded = {name: served.card for name, served in self.models.loaded.items()}
        listed = [loaded[k.name].listing() if k.name in loaded else listing(k) for k in self.models.catalog.models]
        return JSONResponse({"models": listed})

    async def show(self, request: HTTPRequest):
        body = await self.server.read(request)
        if body.get("model") is None and isinstance(body.get("name"), str):  # older clients send `name`
            body["model"] = body["name"]
        model = await self.model_of(body)
        card = model.card
        info = {"general.architecture": card.family, "general.parameter_count": card.parameters}
        if card.context is not None:
            info[f"{card.family}.context_length"] = card.context
        template = model.tokenizer.chat_template or ""
        return JSONResponse(
            {"modelfile": f"FROM {card.name}\n", "parameters": "", "template": template, "details": card.details(),
             "model_info": info, "capabilities": list(card.capabilities), "modified_at": card.modified_at}
        )  # fmt: skip

    async def ps(self, request: HTTPRequest):
        """The loaded models, the memory each holds and when each leaves if no request comes."""
        on_device = mx.default_device() == mx.gpu
        running = []
        for name, served in list(self.models.loaded.items()):
            card = served.card
            expires = expiry(self.models.residency.residents[name])
            extra = {"expires_at": expires, "context_length": card.context or 0, "size_vram": card.size * on_device}
            running.append(card.listing() | extra)
        return JSONResponse({"models": running})

    async def pull(self, request: HTTPRequest):
        """Ollama's pull, through the Hugging Face Hub (`minimlx pull`): `model` is a repo id, with a :QUANT tag
        for a GGUF repo. Its statuses stream as NDJSON (or the last alone with `stream: false`)."""
        body = await self.server.read(request)
        name = optional(body, "model", str, "a repo id such as 'org/name:Q4_K_M'") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("model", "'model' is required: the Hugging Face repo id to pull, as org/name[:QUANT]")
        stream = body.get("stream") is None or flag(body, "stream")
        body.get("insecure")
        ignore_unread(body, "ollama")

        async def statuses() -> AsyncIterator[dict]:
            yield {"status": "pulling manifest"}
            try:
                path = await asyncio.to_thread(hub.pull, name)
            except MinimlxError as e:
                yield {"error": str(e)}
                return
            size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
            yield {"status": f"pulled {path}", "total": size, "completed": size}
            yield {"status": "success"}

        if stream:
            return StreamingResponse((json.dumps(s) + "\n" async for s in statuses()), media_type=NDJSON)
        last = [s async for s in statuses()][-1]
        return JSONResponse(last, status_code=400 if "error" in last else 200)

    async def version(self, request: HTTPRequest):
        return JSONResponse({"version": VERSION})

    def routes(self) -> list[Route]:
        return [
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/version", self.version, methods=["GET"]),
            Route("/api/pull", self.pull, methods=["POST"]),
        ]


async def held_model(server: "TurnServer", body: Body, strict: bool = True) -> "ServedModel":
    """The model an Ollama body names, loaded and held for this request; its `keep_alive` is how long the model stays
    once idle (seconds or a duration such as "5m"; 0 unloads it after this request, negative keeps it). `strict`: the
    name must be a model's, also on a server of one model (Ollama's chat and generate; /api/embed answers any)."""
    name = optional(body, "model", str, "a model name such as 'llama3.2:latest'")
    if name is None:
        raise bad("model", "'model' is required: the name of a model /api/tags lists")
    keep_alive = body.get("keep_alive")
    try:
        keep = None if keep_alive is None else seconds(keep_alive, "keep_alive")
    except InvalidSettingError as e:
        raise bad("keep_alive", str(e)) from None
    return await server.model(body, keep, strict)


def error_body(error: APIError) -> dict:
    return {"error": error.message}


def listing(known: "Known") -> dict:
    """A model not loaded, as /api/tags lists it: from its files (the details its config gives once loaded)."""
    name = known.name if ":" in known.name else f"{known.name}:latest"
    when = datetime.fromtimestamp(known.path.stat().st_mtime, timezone.utc).isoformat()
    digest = hashlib.sha256(str(known.path.resolve()).encode()).hexdigest()
    form = "gguf" if known.path.suffix == ".gguf" else "safetensors"
    details = {"parent_model": "", "format": form, "family": "", "families": [], "parameter_size": "",
               "quantization_level": hub.quant_tag(known.path.name) if form == "gguf" else ""}  # fmt: skip
    return {"name": name, "model": name, "size": known.disk_bytes, "digest": digest, "modified_at": when} | {
        "details": details
    }


def expiry(resident: Resident) -> str:
    """When a loaded model leaves if no request comes, as /api/ps writes it (a far date for never)."""
    if resident.keep_alive == FOREVER:
        return "2999-01-01T00:00:00Z"
    idle_since = time.time() if resident.in_flight else time.time() - (time.monotonic() - resident.last_used)
    return datetime.fromtimestamp(idle_since + resident.keep_alive, timezone.utc).isoformat()


# ---- the request ----


def chat_messages(messages, images: list[bytes]) -> list[dict]:
    """Ollama's messages in the Turn's shape: tool calls get ids (Ollama's have none), each tool result the id
    of the call it answers, the next one not yet answered (by name when the result names its tool), and a user's
    `images` their places before its text (their bytes appended to `images`)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    turns, unanswered = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise bad(f"{where}.role", f"{where} needs a role out of system, user, assistant, tool")
        places = ""
        if message.get("images"):
            if message["role"] != "user":
                raise bad(f"{where}.images", f"{where} is a {message['role']} message; only a user's holds images")
            places = ollama_images(message["images"], f"{where}.images", images)
        content = places + text_content(message.get("content") or "", f"{where}.content")
        turn = {"role": message["role"], "content": content}
        if message["role"] == "assistant":
            calls = [
                ollama_call(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(message.get("tool_calls") or [])
            ]
            if calls:
                turn["tool_calls"] = calls
                unanswered += calls
            if isinstance(message.get("thinking"), str):
                turn["reasoning_content"] = message["thinking"]
        if message["role"] == "tool":
            name = message.get("tool_name")
            answered = next((c for c in unanswered if name is None or c["function"]["name"] == name), None)
            if answered is not None:
                unanswered.remove(answered)
                turn["tool_call_id"] = answered["id"]
        turns.append(turn)
    return turns


def ollama_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(where, f'{where} must be {{"function": {{"name": ..., "arguments": {{...}}}}}}')
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, dict):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments must be an object")
    call_id = f"call_{hashlib.sha256(json.dumps([where, function['name']]).encode()).hexdigest()[:12]}"
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function["name"], "arguments": json.dumps(arguments)},
    }


def tools(body: Body) -> list[dict] | None:
    given = optional(body, "tools", list, "a list of function tools")
    return given or None


def sampling(body: Body) -> dict:
    """Ollama's `options` as the Turn's settings; options this server does not use (num_ctx, num_thread, ...) are
    ignored and named, as the body's unknown fields are."""
    options = optional(body, "options", dict, "an object of model options") or {}
    settings = {"temperature": OLLAMA_TEMPERATURE}
    for name, value in options.items():
        setting = OPTIONS.get(name)
        if setting is None:
            body.ignore(f"options.{name}", "ollama")
            continue
        if name == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1 (no bound) and -2 (fill the context): the room left, as without it
        if name == "stop" and isinstance(value, str):
            value = [value]
        settings[setting] = value
    if isinstance(settings.get("seed"), int):
        settings["seed"] %= 2**32
    return settings


def thinking(think) -> dict:
    """The template variables of `think`: true/false, or an effort ("low", "medium", "high")."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high"):
        return {"enable_thinking": True, "reasoning_effort": think}
    raise bad("think", '\'think\' must be true, false, "low", "medium" or "high"')


def answer_format(format) -> Constraint | None:
    """`format`: "json" (any JSON value an object) or a JSON schema the answer must match."""
    if format is None or format == "":
        return None
    if format == "json":
        return Constraint.json_object()
    if isinstance(format, dict):
        return checked_schema(format, False, "format")
    raise bad("format", "'format' must be \"json\" or a JSON schema object")


# ---- the response ----


class Reply:
    """One answer as Ollama writes it: NDJSON chunks (`message` for /api/chat, `response` for /api/generate), the
    last with `done: true`, its reason and counts; or one object."""

    def __init__(self, model: str, kind: str, answer: "Answer"):
        self.model, self.kind, self.answer = model, kind, answer
        self.started = time.monotonic_ns()
        self.calls: list[dict] = []  # the calls written so far, {"function": {"name", "arguments" (JSON text)}}
        self.finish: str | None = None

    def chunk(self, content: str = "", thinking: str = "", calls: list[dict] | None = None) -> dict:
        now = datetime.now(timezone.utc).isoformat()
        if self.kind == "response":
            body = {"response": content} | ({"thinking": thinking} if thinking else {})
        else:
            message = {"role": "assistant", "content": content}
            message |= ({"thinking": thinking} if thinking else {}) | ({"tool_calls": calls} if calls else {})
            body = {"message": message}
        return {"model": self.model, "created_at": now, **body, "done": False}

    def read(self, piece) -> tuple[str, str]:
        """(content, thinking) of a piece; its tool calls gathered, to be sent whole."""
        content = thinking = ""
        for delta in piece.deltas:
            if delta.kind == "content":
                content += delta.text
            elif delta.kind == "reasoning":
                thinking += delta.text
            elif delta.kind == "tool_call":
                self.calls.append({"function": {"name": delta.name, "arguments": ""}})
            else:
                self.calls[delta.index]["function"]["arguments"] += delta.text
        if piece.finish_reason is not None:
            self.finish = piece.finish_reason
        return content, thinking

    def tool_calls(self) -> list[dict]:
        """The calls with their arguments as objects (a call cut short by num_predict keeps what parses: none)."""
        calls = []
        for call in self.calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                arguments = {}
            calls.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
        return calls

    def done(self) -> dict:
        usage = self.answer.usage()
        first = self.answer.first_output_at
        total = time.monotonic_ns() - self.started
        prompt_time = int(first * 1e9) - self.started if first is not None else total
        last = self.chunk()
        last.update(
            done=True,
            done_reason="length" if self.finish == "length" else "stop",
            total_duration=total,
            load_duration=0,
            prompt_eval_count=usage.prompt_tokens,
            prompt_eval_duration=max(prompt_time, 0),
            eval_count=usage.completion_tokens,
            eval_duration=max(total - prompt_time, 0),
        )
        return last

    async def lines(self) -> AsyncIterator[str]:
        try:
            async for piece in self.answer.pieces():
                content, thinking = self.read(piece)
                if content or thinking:
                    yield json.dumps(self.chunk(content, thinking)) + "\n"
        except APIError as e:
            yield json.dumps(error_body(e)) + "\n"
            return
        if self.calls:
            yield json.dumps(self.chunk(calls=self.tool_calls())) + "\n"
        yield json.dumps(self.done()) + "\n"

    async def whole(self) -> dict:
        content = thinking = ""
        async for piece in self.answer.pieces():
            more, thought = self.read(piece)
            content, thinking = content + more, thinking + thought
        whole = self.done()
        if self.kind == "response":
            whole["response"] = content
            if thinking:
                whole["thinking"] = thinking
        else:
            whole["message"] = self.chunk(content, thinking, self.tool_calls())["message"]
        return whole
