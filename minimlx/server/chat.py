"""OpenAI's chat completions and completions: request bodies into Turns, Answers into its response shapes."""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .blocks import KEEP_ALIVE_COMMENT
from .fields import (
    APIError,
    bad,
    check_body,
    checked_schema,
    constraint_fields,
    flag,
    ignore_unread,
    integer,
    number,
    optional,
    stop_strings,
    text_content,
)
from .hangups import until_disconnected
from .images import content_with_images
from .turns import Piece, TokenLogprob, Turn, Usage

if TYPE_CHECKING:
    from .protocol import TurnServer

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20


def routes(server: "TurnServer") -> list[Route]:
    async def chat_completions(request: HTTPRequest):
        body = await server.read(request)
        turn, stream = chat_turn(body), streaming(body)
        ignore_unread(body, "chat")
        model = await server.model(body)
        answer = await model.start(turn)
        reply = Reply(model.name, chat=True, choices=turn.n, logprobs=turn.logprobs is not None)
        return await respond(request, reply, answer, stream, body)

    async def completions(request: HTTPRequest):
        body = await server.read(request)
        check_body(body, "completions")
        model = await server.model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            prompt = model.tokenizer.encode(prompt)
        elif not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
            raise bad("prompt", "'prompt' must be a non-empty string or a list of token ids")
        logprobs = integer(body, "logprobs", None)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"'logprobs' must be from 0 to {MAX_TOP_LOGPROBS}, got {logprobs}")
        turn = Turn([], settings=settings(body, chat=False), logprobs=logprobs, n=choices(body))
        turn.constraint = constraint_fields(body)
        stream = streaming(body)
        ignore_unread(body, "completions")
        answer = await model.start_raw(prompt, turn, "prompt")
        reply = Reply(model.name, chat=False, choices=turn.n, logprobs=logprobs is not None)
        return await respond(request, reply, answer, stream, body)

    async def apply_template(request: HTTPRequest):
        """llama.cpp's /apply-template: the prompt text a chat body renders to, nothing generated."""
        body = await server.read(request)
        turn = chat_turn(body)
        return JSONResponse({"prompt": (await server.model(body)).render(turn)})

    async def tokenize(request: HTTPRequest):
        """llama.cpp's /tokenize: the token ids of `content` (no special tokens added unless `add_special`)."""
        body = await server.read(request)
        content = optional(body, "content", str, "a string")
        if content is None:
            raise bad("content", "'content' must be the text to tokenize")
        add_special = flag(body, "add_special")
        ignore_unread(body, "tokenize")
        model = await server.model(body)
        return JSONResponse({"tokens": model.tokenizer.encode(content, add_special_tokens=add_special)})

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]


def streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage), read before anything is started: a refusal after it would leave it running."""
    include_usage = flag(optional(body, "stream_options", dict, "an object") or {}, "include_usage")
    return flag(body, "stream"), include_usage


async def respond(request: HTTPRequest, reply: "Reply", answer, stream: tuple[bool, bool], body):
    headers = answer.headers(body)
    if stream[0]:
        return StreamingResponse(reply.stream(answer, stream[1]), media_type="text/event-stream", headers=headers)

    async def whole():
        async for piece in answer.pieces():
            reply.add(piece)
        return reply.whole(answer.usage())

    return JSONResponse(await until_disconnected(request, whole()), headers=headers)


# ---- reading a chat completions body ----


def settings(body: dict, chat: bool) -> dict:
    """The SamplingSettings fields of a body (the server's own defaults fill the rest)."""
    max_tokens = integer(body, "max_completion_tokens", None) if chat else None
    max_tokens = integer(body, "max_tokens", None) if max_tokens is None else max_tokens
    temperature = number(body, "temperature", 1.0)
    if temperature > 2:  # OpenAI's range, which clients are written against
        raise bad("temperature", f"'temperature' must be at most 2, got {temperature}")
    seed = integer(body, "seed", None)  # OpenAI takes any integer
    fields = {
        "temperature": temperature,
        "top_p": number(body, "top_p", 1.0),
        "top_k": integer(body, "top_k", 0),
        "min_p": number(body, "min_p", 0.0),
        "seed": seed % 2**32 if seed is not None else None,
        "stop": stop_strings(body),
        "logit_bias": logit_bias(body),
    }
    return fields | ({"max_tokens": max_tokens} if max_tokens is not None else {})


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's {"token id": bias}; whether each id is in the vocabulary, the engine checks."""
    biases = optional(body, "logit_bias", dict, "an object of token ids to biases") or {}
    if not all(key.lstrip("-").isdigit() for key in biases):
        raise bad("logit_bias", "'logit_bias' keys must be token ids (whole numbers as strings)")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in biases.values()):
        raise bad("logit_bias", "'logit_bias' values must be numbers from -100 to 100")
    return {int(key): float(value) for key, value in biases.items()}


def choices(body: dict) -> int:
    n = integer(body, "n", 1)
    if n < 1:
        raise bad("n", f"'n' must be at least 1, got {n}")
    return n


def chat_turn(body: dict) -> Turn:
    check_body(body, "chat")
    logprobs, top = flag(body, "logprobs"), integer(body, "top_logprobs", None)
    if top is not None and not (logprobs and 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad("top_logprobs", f"'top_logprobs' must be from 0 to {MAX_TOP_LOGPROBS}, with 'logprobs': true")
    tools = optional(body, "tools", list, "a list of function tools")
    kwargs = optional(body, "chat_template_kwargs", dict, "an object of template variables") or {}
    effort = optional(body, "reasoning_effort", str, "a string such as 'low', 'medium' or 'high'")
    if effort is not None:  # what templates that take an effort read (gpt-oss's)
        kwargs = {"reasoning_effort": effort, **kwargs}
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    images = []
    return Turn(
        messages=chat_messages(body, images),
        tools=tools or None,
        tool_choice=tool_choice(body.get("tool_choice")),
        parallel_tool_calls=parallel,
        constraint=one_constraint(response_format(body), constraint_fields(body)),
        settings=settings(body, chat=True),
        logprobs=(top or 0) if logprobs else None,
        template_kwargs=kwargs,
        n=choices(body),
        cache_key=optional(body, "prompt_cache_key", str, "a string"),
        images=images,
    )


def tool_choice(choice) -> str:
    """ "auto", "none", "required", or the name a {"type": "function", "function": {"name"}} choice gives."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad(
            "tool_choice",
            '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        )
    return name


def one_constraint(format_constraint, field_constraint):
    """The one constraint a chat body asks for: `response_format`'s or an extension field's, not both."""
    if format_constraint is not None and field_constraint is not None:
        raise bad("response_format", "give either 'response_format' or a grammar field (regex, grammar, ...), not both")
    return format_constraint or field_constraint


def response_format(body: dict):
    """The Constraint of `response_format`: text (none), json_object (with llama.cpp's optional schema) or
    json_schema."""
    from ..decode.grammar import Constraint

    format = optional(body, "response_format", dict, "an object")
    kind = (format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = format.get("schema")
        return Constraint.json_object() if schema is None else checked_schema(schema, False, "response_format")
    if kind == "json_schema":
        spec = format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad("response_format", "'response_format.json_schema' must be an object with a 'schema'")
        return checked_schema(spec.get("schema", {}), spec.get("strict") is True, "response_format")
    raise bad("response_format", f"'response_format.type' must be text, json_object or json_schema, got {kind!r}")


def chat_messages(body: dict, images: list) -> list[dict]:
    """The messages, checked, in Turn's shape: developer becomes system, content becomes text (a user's image parts
    their places in it, their bytes appended to `images`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}] needs a role out of {', '.join(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        calls = message.get("tool_calls") if role == "assistant" else None
        content, param = message.get("content"), f"messages[{i}].content"
        if content is None and calls:
            content = ""
        elif role == "user":
            content = content_with_images(content, param, images)
        else:
            content = text_content(content, param)
        turn = {"role": role, "content": content}
        if calls:
            turn["tool_calls"] = tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "assistant" and isinstance(message.get("reasoning_content"), str):
            turn["reasoning_content"] = message["reasoning_content"]
        if role == "tool":
            turn["tool_call_id"] = str(message.get("tool_call_id", ""))
        turns.append(turn)
    return turns


def tool_calls(calls, param: str) -> list[dict]:
    def call(c):
        function = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise bad(param, f"each of '{param}' needs a function with a name and arguments")
        arguments = function.get("arguments", "{}")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return {
            "id": str(c.get("id", "")),
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }

    if not isinstance(calls, list):
        raise bad(param, f"'{param}' must be a list")
    return [call(c) for c in calls]


# ---- answering ----


def logprob_entry(logprob: TokenLogprob) -> dict:
    top = [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in logprob.top]
    return {"token": logprob.token, "logprob": logprob.logprob, "bytes": logprob.bytes, "top_logprobs": top}


class Reply:
    """The answer to one (chat) completion request, in OpenAI's shapes: whole, or as server-sent events."""

    def __init__(self, model_name: str, chat: bool, choices: int, logprobs: bool):
        self.model_name, self.chat, self.logprobs = model_name, chat, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.content = [[] for _ in range(choices)]
        self.reasoning = [[] for _ in range(choices)]
        self.calls: list[list[dict]] = [[] for _ in range(choices)]
        self.tokens: list[list[TokenLogprob]] = [[] for _ in range(choices)]
        self.finish: list[str | None] = [None] * choices

    def add(self, piece: Piece) -> None:
        i = piece.index
        for delta in piece.deltas:
            if delta.kind == "content":
                self.content[i].append(delta.text)
            elif delta.kind == "reasoning":
                self.reasoning[i].append(delta.text)
            elif delta.kind == "tool_call":
                function = {"name": delta.name, "arguments": ""}
                self.calls[i].append({"id": delta.id, "type": "function", "function": function})
            else:
                self.calls[i][delta.index]["function"]["arguments"] += delta.text
        if piece.logprob is not None:
            self.tokens[i].append(piece.logprob)
        self.finish[i] = piece.finish_reason

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model_name,
            "system_fingerprint": "minimlx",
            "choices": choices,
        }

    def logprobs_of(self, tokens: list[TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [logprob_entry(t) for t in tokens], "refusal": None}
        offsets, offset = [], 0
        for t in tokens:
            offsets.append(offset)
            offset += len(t.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{token: lp for token, lp, _ in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def whole(self, usage: Usage) -> dict:
        choices = []
        for i, finish in enumerate(self.finish):
            content, logprobs = "".join(self.content[i]), self.logprobs_of(self.tokens[i])
            if not self.chat:
                choices.append({"index": i, "text": content, "logprobs": logprobs, "finish_reason": finish})
                continue
            message = {"role": "assistant", "content": content if content or not self.calls[i] else None}
            if self.reasoning[i]:
                message["reasoning_content"] = "".join(self.reasoning[i])
            if self.calls[i]:
                message["tool_calls"] = self.calls[i]
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return {**self.envelope(choices, chunk=False), "usage": usage_body(usage)}

    def chunks(self, piece: Piece) -> list[dict]:
        """The choices of the events for one piece: one per delta (the first carrying the token's logprob), a
        logprob alone when the token added no text, then the finish."""
        logprob = [piece.logprob] if piece.logprob is not None else []
        choices = []
        deltas = [d for d in piece.deltas if d.text or d.kind == "tool_call"]
        for delta in deltas or ([None] if logprob else []):
            if not self.chat:
                choice = {"index": piece.index, "text": delta.text if delta else "", "finish_reason": None}
            else:
                choice = {"index": piece.index, "delta": chat_delta(delta), "finish_reason": None}
            choice["logprobs"] = self.logprobs_of(logprob)
            choices.append(choice)
            logprob = []
        if piece.finish_reason is not None:
            finish = {"delta": {}} if self.chat else {"text": ""}
            choices.append({"index": piece.index, **finish, "logprobs": None, "finish_reason": piece.finish_reason})
        return choices

    async def stream(self, answer, include_usage: bool) -> AsyncIterator[str]:
        def event(data: dict) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        if self.chat:
            role = {"delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
            yield event(self.envelope([{"index": i, **role} for i in range(len(self.finish))], chunk=True))
        try:
            async for piece in answer.pieces(heartbeat=True):
                if piece is None:  # a long prompt is being read: a comment keeps the connection alive
                    yield KEEP_ALIVE_COMMENT
                    continue
                for choice in self.chunks(piece):
                    yield event(self.envelope([choice], chunk=True))
        except APIError as e:
            yield event({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
        if include_usage:
            yield event({**self.envelope([], chunk=True), "usage": usage_body(answer.usage())})
        yield "data: [DONE]\n\n"


def chat_delta(delta) -> dict:
    if delta is None:
        return {}
    if delta.kind == "content":
        return {"content": delta.text}
    if delta.kind == "reasoning":
        return {"reasoning_content": delta.text}
    if delta.kind == "tool_call":
        function = {"name": delta.name, "arguments": ""}
        return {"tool_calls": [{"index": delta.index, "id": delta.id, "type": "function", "function": function}]}
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.text}}]}


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
