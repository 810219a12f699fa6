"""Ollama's API (`/api/*`): what JetBrains, Zed, n8n, the VS Code Ollama extension, LangChain's ChatOllama and the
official `ollama` client speak.

A translation, like the OpenAI and Anthropic endpoints: `/api/chat` and `/api/generate` read their body into a
`Turn` (Ollama's `options` into sampling settings, `format` into a grammar, `think` into the template's variables)
and write the `Answer`'s pieces as Ollama's NDJSON stream (or one object with `stream: false`); `/api/tags`,
`/api/show`, `/api/ps` and `/api/version` describe the loaded model (`ModelCard`); `/api/pull` downloads from the
Hugging Face Hub (minimlx/io/hub.py). Errors are Ollama's
`{"error": "..."}`.
"""

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..decode.grammar import Constraint
from ..errors import MinimlxError
from ..io import hub
from .fields import APIError, Body, bad, checked_schema, flag, ignore_unread, optional, text_content
from .hangups import until_disconnected
from .turns import Turn

if TYPE_CHECKING:
    from .answer import Answer
    from .protocol import TurnServer

VERSION = "0.12.0"  # the Ollama API version whose shapes these are (clients check it is recent enough)
NDJSON = "application/x-ndjson"
# Ollama's options -> the Turn's sampling settings (num_predict -1: no bound but the context's)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty"}  # fmt: skip
OLLAMA_TEMPERATURE = 0.8  # Ollama's default, which its clients expect when they send none


@dataclass(frozen=True)
class ModelCard:
    """How the Ollama API describes the loaded model: its name as clients write it (`name:tag`), bytes held,
    parameters, family, file format, quantization, context and a digest of its weights."""

    name: str
    source: str  # the model as the server was given it (a path, a repo id, a short name)
    size: int
    parameters: int
    family: str
    format: str
    quantization: str
    context: int | None
    digest: str
    modified_at: str
    capabilities: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module, name: str, source: str, capabilities: tuple[str, ...]) -> "ModelCard":
        from ..io.resolve import resolve

        try:
            path = resolve(source)
            when = path.stat().st_mtime
        except (MinimlxError, OSError):  # a model handed over already loaded (tests, the Python API)
            path, when = Path(source), time.time()
        arrays = [a for _, a in tree_flatten(model.parameters())]
        config = model.config
        bits = {getattr(m, "bits", None) for m in model.modules() if isinstance(m, nn.QuantizedLinear)}
        dtype = next((a.dtype for a in arrays if mx.issubdtype(a.dtype, mx.floating)), mx.float32)
        quantization = f"Q{max(bits)}" if bits else str(dtype).removeprefix("mlx.core.").upper().replace("LOAT", "")
        digest = hashlib.sha256(repr(config).encode() + str(sum(a.nbytes for a in arrays)).encode()).hexdigest()
        short = Path(name).name.removesuffix(".gguf") if Path(name).exists() else name  # a path: its own name
        return cls(
            name=short if ":" in short else f"{short}:latest",
            source=name,
            size=sum(a.nbytes for a in arrays),
            parameters=parameter_count(model),
            family=type(config).__name__.removesuffix("Config").lower(),
            format="gguf" if str(path).endswith(".gguf") else "safetensors",
            quantization=quantization,
            context=config.max_positions,
            digest=digest,
            modified_at=datetime.fromtimestamp(when, timezone.utc).isoformat(),
            capabilities=capabilities,
        )

    def details(self) -> dict:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family],
            "parameter_size": parameter_size(self.parameters),
            "quantization_level": self.quantization,
        }

    def listing(self) -> dict:
        """The model as /api/tags lists it."""
        common = {"name": self.name, "model": self.name, "size": self.size, "digest": self.digest}
        return common | {"modified_at": self.modified_at, "details": self.details()}

    def answers_to(self, name: str | None) -> bool:
        """Whether a request naming `name` (`model`, with or without `:latest`) is for this model."""
        return name is None or name in (self.name, self.source) or f"{name}:latest" == self.name


def parameter_count(model: nn.Module) -> int:
    """The parameters `model` holds, a packed weight counted as the values it stands for (its scales not counted)."""
    count = 0
    for _, module in model.named_modules():
        own = module.parameters()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = own["weight"].shape[-2:]
            count += rows * packed * 32 // module.bits + (own["bias"].size if "bias" in own else 0)
            continue
        count += sum(a.size for a in own.values() if isinstance(a, mx.array))  # its own arrays, not its children's
    return count


def parameter_size(count: int) -> str:
    """Ollama's way of writing a parameter count: 135.0M, 8.0B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


class OllamaAPI:
    """The /api/* endpoints over a server (`TurnServer`) and the card of its model."""

    def __init__(self, server: "TurnServer", card: ModelCard):
        self.server, self.card = server, card

    def model_of(self, body: Body) -> None:
        name = optional(body, "model", str, "a model name such as 'llama3.2:latest'")
        if name is None:
            raise bad("model", "'model' is required: the name of a model /api/tags lists")
        if not self.card.answers_to(name):
            raise APIError(404, f"model '{name}' not found; /api/tags lists {self.card.name}", "model", "not_found")

    async def chat(self, request: HTTPRequest):
        body = await self.server.read(request)
        self.model_of(body)
        turn = Turn(chat_messages(body.get("messages")), tools=tools(body))
        return await self.answer(request, body, turn, "message")

    async def generate(self, request: HTTPRequest):
        body = await self.server.read(request)
        self.model_of(body)
        prompt = optional(body, "prompt", str, "a string") or ""
        if optional(body, "images", list, "a list of base64 images"):
            raise bad("images", "image input is not supported by this model; send text")
        system = optional(body, "system", str, "a string")
        turn = Turn(([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}])
        return await self.answer(request, body, turn, "response")

    async def answer(self, request: HTTPRequest, body: Body, turn: Turn, kind: str):
        turn.settings, turn.template_kwargs = sampling(body), thinking(body.get("think"))
        turn.constraint = answer_format(body.get("format"))
        stream = body.get("stream") is None or flag(body, "stream")
        raw = kind == "response" and flag(body, "raw")
        ignore_unread(body, "ollama")
        if raw:
            prompt = self.server.tokenizer.encode(turn.messages[-1]["content"])
            started = await self.server.start_raw(prompt, turn, "prompt")
        else:
            started = await self.server.start(turn)
        reply = Reply(self.card.name, kind, started)
        if stream:
            return StreamingResponse(reply.lines(), media_type=NDJSON, headers=started.headers(body))
        whole = await until_disconnected(request, reply.whole())
        return JSONResponse(whole, headers=started.headers(body))

    async def tags(self, request: HTTPRequest):
        return JSONResponse({"models": [self.card.listing()]})

    async def show(self, request: HTTPRequest):
        body = await self.server.read(request)
        name = body.get("model") or body.get("name")
        if not self.card.answers_to(name) or name is None:
            raise APIError(404, f"model '{name}' not found; /api/tags lists {self.card.name}", "model", "not_found")
        info = {"general.architecture": self.card.family, "general.parameter_count": self.card.parameters}
        if self.card.context is not None:
            info[f"{self.card.family}.context_length"] = self.card.context
        template = self.server.tokenizer.chat_template or ""
        card = self.card
        return JSONResponse(
            {"modelfile": f"FROM {card.name}\n", "parameters": "", "template": template, "details": card.details(),
             "model_info": info, "capabilities": list(card.capabilities), "modified_at": card.modified_at}
        )  # fmt: skip

    async def ps(self, request: HTTPRequest):
        running = self.card.listing() | {"expires_at": "2999-01-01T00:00:00Z", "context_length": self.card.context or 0}
        on_device = mx.default_device() == mx.gpu
        return JSONResponse({"models": [running | {"size_vram": self.card.size if on_device else 0}]})

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


def error_body(error: APIError) -> dict:
    return {"error": error.message}


# ---- the request ----


def chat_messages(messages) -> list[dict]:
    """Ollama's messages in the Turn's shape: tool calls get ids (Ollama's have none), and each tool result the id
    of the call it answers, the next one not yet answered (by name when the result names its tool)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    turns, unanswered = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
            raise bad(f"{where}.role", f"{where} needs a role out of system, user, assistant, tool")
        if message.get("images"):
            raise bad(f"{where}.images", "image input is not supported by this model; send text")
        turn = {"role": message["role"], "content": text_content(message.get("content") or "", f"{where}.content")}
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
