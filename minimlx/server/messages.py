"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

`system` and `messages` (text, tool_use, tool_result and thinking blocks) become a `Turn`'s chat messages; tools
with an `input_schema` its function tools. The answer comes back as content blocks (thinking, text, tool_use), whole
or as Anthropic's stream of events; errors in Anthropic's shape (`error_body`, which app.py answers with on these
paths).
"""

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .blocks import Block, Blocks, Change, server_sent
from .fields import (
    APIError,
    Body,
    bad,
    check_body,
    effort_variable,
    flag,
    ignore_unread,
    integer,
    number,
    text_content,
    text_field,
)
from .hangups import until_disconnected
from .images import IMAGE_PLACE, image_part
from .turns import Turn

if TYPE_CHECKING:
    from .answer import Answer
    from .protocol import TurnServer

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
PING = {"type": "ping"}  # what Anthropic's streams send to keep a quiet connection alive
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
NO_IMAGES = "images inside a tool_result are not read; send them as image blocks of a user message"
ROLES = ("user", "assistant", "system")
# content blocks of tools that Anthropic's servers run, which this server leaves out of the prompt
IGNORED_BLOCKS = ("server_tool_use", "web_search_tool_result", "code_execution_tool_result", "container_upload")


def routes(server: "TurnServer") -> list[Route]:
    async def create(request: HTTPRequest):
        body = await server.read(request)
        turn = read_turn(body)
        turn.settings = sampling(body)
        stream = flag(body, "stream")
        ignore_unread(body, "messages")
        model = await server.model(body)
        answer = await model.start(turn)
        reply, headers = Reply(model.name, answer), answer.headers(body)
        if stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream", headers=headers)
        return JSONResponse(await until_disconnected(request, reply.whole()), headers=headers)

    async def count_tokens(request: HTTPRequest):
        body = await server.read(request)
        turn = read_turn(body)
        ignore_unread(body, "messages")
        return JSONResponse({"input_tokens": (await server.model(body)).count_tokens(turn)})

    return [
        Route("/v1/messages", create, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


def error_body(error: APIError) -> dict:
    """`error` in Anthropic's shape, its type chosen by the HTTP status as Anthropic's own API does."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# ---- the request ----


def read_turn(body: Body) -> Turn:
    """The conversation a Messages body asks about (what count_tokens counts): system, messages (system messages
    among them too, as Claude Code sends them mid-conversation), tools, tool choice, thinking and effort; not yet
    how to sample its answer."""
    body = body if isinstance(body, Body) else Body(body)
    check_body(body, "messages")
    system = body.get("system")
    messages = [{"role": "system", "content": text_content(system, "system")}] if system else []
    history = body.get("messages")
    if not isinstance(history, list):
        raise bad("messages", "'messages' must be a list of {role, content} objects")
    images = []
    for i, message in enumerate(history):
        messages += chat_messages(message, f"messages[{i}]", images)
    if not history:  # llama.cpp's server answers an empty conversation too: from an empty user turn
        messages.append({"role": "user", "content": ""})
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list of {name, description, input_schema} tools")
    choice, parallel = tool_choice(body.get("tool_choice"))
    functions = [function_tool(tool, f"tools[{i}]", body) for i, tool in enumerate(tools)]
    return Turn(
        messages,
        tools=[f for f in functions if f is not None] or None,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        template_kwargs=thinking(body.get("thinking")) | effort_variable(body, "output_config", "messages"),
        images=images,
    )


def sampling(body: dict) -> dict:
    """How to sample the answer: the Turn's settings."""
    max_tokens = integer(body, "max_tokens", None)
    if max_tokens is None:
        raise bad("max_tokens", "'max_tokens' is required: the most tokens the answer may take")
    temperature = number(body, "temperature", 1.0)
    if temperature > 1:  # Anthropic's range
        raise bad("temperature", f"'temperature' must be from 0 to 1, got {temperature}")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list):
        raise bad("stop_sequences", "'stop_sequences' must be a list of strings")
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": number(body, "top_p", 1.0),
        "top_k": integer(body, "top_k", 0),
        "stop": stop,
    }


def chat_messages(message, param: str, images: list) -> list[dict]:
    """One Anthropic message as chat messages: an assistant's tool_use blocks become its tool_calls and its
    thinking its reasoning_content; a user's tool_result blocks become tool messages, before any text it has, and
    its image blocks places in its text (their bytes appended to `images`); a system message (Claude Code's
    mid-conversation reminders) stays a system message, its text joined."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad(f"{param}.role", f"{param} needs a role out of {', '.join(ROLES)}")
    role, content = message["role"], message.get("content")
    if role == "system":
        return [{"role": "system", "content": text_content(content, f"{param}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"{param}.content", f"{param}.content must be a string or a list of content blocks")
    texts, reasoning, calls, results = [], [], [], []
    for i, block in enumerate(content):
        where = f"{param}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(text_field(block, "text", where))
        elif kind == "image" and role == "user":
            images.append(image_part(block, where))
            texts.append(IMAGE_PLACE)
        elif kind in IGNORED_BLOCKS:
            continue
        elif role == "assistant" and kind == "thinking":
            reasoning.append(text_field(block, "thinking", where))
        elif role == "assistant" and kind == "redacted_thinking":
            continue  # another model's encrypted thinking: nothing this one can read
        elif role == "assistant" and kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{where}.input", f"{where}.input must be an object")
            function = {"name": text_field(block, "name", where), "arguments": json.dumps(arguments)}
            calls.append({"id": text_field(block, "id", where), "type": "function", "function": function})
        elif role == "user" and kind == "tool_result":
            output = tool_result_text(block.get("content", ""), f"{where}.content")
            results.append({"role": "tool", "tool_call_id": text_field(block, "tool_use_id", where), "content": output})
        else:
            raise bad(f"{where}.type", f"{where} is a '{kind}' block, which a {role} message cannot hold here")
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    reply = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        reply["reasoning_content"] = "".join(reasoning)
    if calls:
        reply["tool_calls"] = calls
    return [reply]


def tool_result_text(content, param: str) -> str:
    if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "image" for b in content):
        raise bad(param, NO_IMAGES)
    return text_content(content, param)


def function_tool(tool, param: str, body: Body) -> dict | None:
    """An Anthropic tool {"name", "description", "input_schema"} as an OpenAI function tool; None for a tool
    Anthropic's servers run (web search, code execution, ...: `{"type": "web_search_20250305", ...}`), which this
    server cannot, so it leaves it out of the prompt (logged, and named in the response's ignored header)."""
    if not isinstance(tool, dict):
        raise bad(param, f"{param} must be a tool object with a name and an input_schema")
    if tool.get("type", "custom") != "custom":
        body.ignore(f"tools[].type={tool['type']}", "messages")
        return None
    if "input_schema" not in tool:
        raise bad(param, f"{param} must have an input_schema (a JSON Schema object)")
    if not isinstance(tool["input_schema"], dict):
        raise bad(f"{param}.input_schema", f"{param}.input_schema must be a JSON Schema object")
    function = {"name": text_field(tool, "name", param), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = text_field(tool, "description", param)
    return {"type": "function", "function": function}


def tool_choice(choice) -> tuple[str, bool]:
    """(the Turn's tool_choice, whether calls may come in parallel) of Anthropic's tool_choice."""
    if choice is None:
        return "auto", True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        name = choice["name"]
    elif kind in TOOL_CHOICES:
        name = TOOL_CHOICES[kind]
    else:
        message = '\'tool_choice\' must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        raise bad("tool_choice", message + '{"type": "tool", "name": ...}')
    return name, not flag(choice, "disable_parallel_tool_use")


def thinking(setting) -> dict:
    """The chat-template variables of `thinking`: enable_thinking, which templates that can think read."""
    if setting is None:
        return {}
    kind = setting.get("type") if isinstance(setting, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        message = '\'thinking\' must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}'
        raise bad("thinking", message)
    return {"enable_thinking": kind != "disabled"}


# ---- the response ----


class Reply:
    """One answer as an Anthropic message: whole, or as server-sent events."""

    def __init__(self, model_name: str, answer: "Answer"):
        self.model_name, self.answer = model_name, answer
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks = Blocks()
        self.tool_ids: dict[int, str] = {}  # a tool_use block's position -> its id

    async def whole(self) -> dict:
        async for piece in self.answer.pieces():
            self.blocks.add(piece)
        self.blocks.finish()
        return self.message([self.content_block(block) for block in self.blocks.blocks], **self.ending())

    async def events(self) -> AsyncIterator[str]:
        started = self.message([], stop_reason=None, stop_sequence=None)
        yield server_sent({"type": "message_start", "message": started})
        try:
            async for piece in self.answer.pieces(heartbeat=True):
                if piece is None:
                    yield server_sent(PING)
                    continue
                for change in self.blocks.add(piece):
                    for event in self.changed(change):
                        yield server_sent(event)
            for change in self.blocks.finish():
                for event in self.changed(change):
                    yield server_sent(event)
        except APIError as e:
            yield server_sent(error_body(e))
            return
        usage = {"output_tokens": self.answer.usage().completion_tokens}
        yield server_sent({"type": "message_delta", "delta": self.ending(), "usage": usage})
        yield server_sent({"type": "message_stop"})

    def changed(self, change: Change) -> list[dict]:
        block, at = change.block, {"index": change.block.position}
        if change.what == "start":
            started = self.content_block(Block(block.kind, block.position, name=block.name))
            return [{"type": "content_block_start", **at, "content_block": started}]
        if change.what == "delta":
            if block.kind == "tool_call":
                delta = {"type": "input_json_delta", "partial_json": change.text}
            elif block.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": change.text}
            else:
                delta = {"type": "text_delta", "text": change.text}
            return [{"type": "content_block_delta", **at, "delta": delta}]
        stopped = [{"type": "content_block_stop", **at}]
        if block.kind == "reasoning":  # Anthropic closes a thinking block with its signature (this server has none)
            signed = {"type": "content_block_delta", **at, "delta": {"type": "signature_delta", "signature": ""}}
            return [signed] + stopped
        return stopped

    def content_block(self, block: Block) -> dict:
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text, "signature": ""}
        if block.kind == "content":
            return {"type": "text", "text": block.text}
        tool_id = self.tool_ids.setdefault(block.position, f"toolu_{uuid.uuid4().hex[:24]}")
        return {"type": "tool_use", "id": tool_id, "name": block.name, "input": call_input(block.text)}

    def ending(self) -> dict:
        """Why the answer stopped: Anthropic's stop_reason and, when a stop string ended it, that string."""
        if self.blocks.stop_string is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": self.blocks.stop_string}
        return {"stop_reason": STOP_REASONS[self.blocks.finish_reason], "stop_sequence": None}

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
        usage = self.answer.usage()
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": usage.prompt_tokens - usage.cached_tokens,  # Anthropic counts cached input apart
                "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": usage.cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }


def call_input(arguments: str) -> dict:
    """A tool call's input: its JSON arguments, or nothing where they are not a whole object (the answer ran out
    of max_tokens inside them, which its stop_reason says)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
