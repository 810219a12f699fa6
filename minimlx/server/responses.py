"""OpenAI's Responses API (`POST /v1/responses`), stateless: every request carries its whole conversation.

`input` (a string, or message, function_call and function_call_output items) and `instructions` become a `Turn`'s
chat messages; function tools, `tool_choice` and `text.format` its tools and constraint. The answer comes back as
output items (reasoning, message, function calls), whole or as the documented stream of events.
"""

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..decode.grammar import Constraint
from ..errors import InvalidSettingError
from .blocks import Block, Blocks, Change, server_sent
from .fields import APIError, bad, check_body, check_schema_size, flag, integer, number, refuse_unread, text_field
from .turns import Turn

if TYPE_CHECKING:
    from .app import Answer, Server

MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")  # reasoning items' too
ITEM_PREFIXES = {"reasoning": "rs", "content": "msg", "tool_call": "fc"}
UNSTORED = ("previous_response_id", "conversation")  # what a stateful server would look up


def routes(server: "Server") -> list[Route]:
    async def create(request: HTTPRequest):
        body = await server.read(request)
        turn, echo = read_request(body)
        stream = flag(body, "stream")
        refuse_unread(body)
        reply = Reply(server.model_name, echo, await server.start(turn))
        if stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        return JSONResponse(await reply.whole())

    return [Route("/v1/responses", create, methods=["POST"])]


# ---- the request ----


def read_request(body: dict) -> tuple[Turn, dict]:
    """The body's Turn, and the request fields the response repeats back."""
    check_body(body, "responses")
    for name in UNSTORED:
        if body.get(name) is not None:
            raise bad(name, f"'{name}' is not supported: this server stores nothing; send the whole conversation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "'instructions' must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += input_messages(body.get("input"))
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list of function tools")
    choice = body.get("tool_choice", "auto")
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise bad("text", '\'text\' must be an object, such as {"format": {"type": "json_object"}}')
    text_format = text.get("format") or {"type": "text"}
    max_output_tokens = integer(body, "max_output_tokens", None)
    temperature = number(body, "temperature", 1.0)
    if temperature > 2:  # OpenAI's range, which clients are written against
        raise bad("temperature", f"'temperature' must be at most 2, got {temperature}")
    top_p = number(body, "top_p", 1.0)
    settings = {"temperature": temperature, "top_p": top_p}
    if max_output_tokens is not None:
        settings["max_tokens"] = max_output_tokens
    metadata = body.get("metadata")
    turn = Turn(
        messages,
        tools=[chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)] or None,
        tool_choice=tool_choice(choice),
        parallel_tool_calls=body.get("parallel_tool_calls") is None or flag(body, "parallel_tool_calls"),
        constraint=constraint(text_format),
        settings=settings,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "parallel_tool_calls": turn.parallel_tool_calls,
        "temperature": temperature,
        "text": {"format": text_format},
        "tool_choice": choice,
        "tools": tools,
        "top_p": top_p,
    }
    return turn, echo


def input_messages(items) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds messages and the function calls and
    outputs of earlier turns (an assistant's calls join its message, as a chat's tool_calls do)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "'input' must be a string or a non-empty list of input items")
    messages = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(param, f"{param} must be an object")
        kind = item.get("type", "message")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = MESSAGE_ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None:
                raise bad(f"{param}.role", f"{param} needs a role out of {', '.join(MESSAGE_ROLES)}")
            content = message_text(item.get("content"), f"{param}.content")
            if role == "assistant" and last is not None and not last["content"] and "tool_calls" not in last:
                last["content"] = content  # the answer its reasoning item came before
            else:
                messages.append({"role": role, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            messages.append({"role": "assistant", "content": "", "reasoning_content": message_text(parts, param)})
        elif kind == "function_call":
            function = {"name": text_field(item, "name", param), "arguments": text_field(item, "arguments", param)}
            call = {"id": text_field(item, "call_id", param), "type": "function", "function": function}
            if last is None:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = message_text(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": text_field(item, "call_id", param), "content": output})
        else:
            message = f"{param} is a '{kind}' item; this server reads message, function_call and function_call_output"
            raise bad(f"{param}.type", message)
    return messages


def message_text(content, param: str) -> str:
    """A message's text: a string, or a list of input_text/output_text (or reasoning/summary text) parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(param, f"'{param}' must be a string or a list of input_text parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{param}[{i}]", f"{kind} input is not supported by this model; send text")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            message = f'{param}[{i}] must be an input_text part: {{"type": "input_text", "text": ...}}'
            raise bad(f"{param}[{i}]", message)
        texts.append(part["text"])
    return "".join(texts)


def chat_tool(tool, param: str) -> dict:
    """A Responses function tool {"type": "function", "name", "description", "parameters", "strict"} in the chat
    shape, {"type": "function", "function": {...}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad(param, f"{param} is a '{kind}' tool; this server runs function tools only")
    function = {"name": text_field(tool, "name", param)}
    if tool.get("description") is not None:
        function["description"] = text_field(tool, "description", param)
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad(f"{param}.parameters", f"{param}.parameters must be a JSON Schema object")
        function["parameters"] = parameters
    if tool.get("strict") is not None:
        function["strict"] = flag(tool, "strict")
    return {"type": "function", "function": function}


def tool_choice(choice) -> str:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return choice["name"]
    message = '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "name": ...}'
    raise bad("tool_choice", message)


def constraint(text_format) -> Constraint | None:
    """`text.format` as the answer's grammar: none for plain text, any JSON object, or one matching a schema."""
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        schema = text_format.get("schema")
        if not isinstance(schema, dict):
            raise bad("text.format.schema", "text.format.schema must be a JSON Schema object")
        check_schema_size(schema, "text.format.schema")
        try:
            return Constraint.json_schema(schema, flag(text_format, "strict"))
        except InvalidSettingError as e:
            raise bad("text.format.schema", str(e)) from None
    raise bad("text.format", 'text.format.type must be "text", "json_object" or "json_schema"')


# ---- the response ----


class Reply:
    """One answer as a Responses `response` object: whole, or as server-sent events."""

    def __init__(self, model_name: str, echo: dict, answer: "Answer"):
        self.model_name, self.echo, self.answer = model_name, echo, answer
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.blocks = Blocks()
        self.item_ids: list[str] = []  # each block's item id, given when it starts
        self.sequence_number = 0

    async def whole(self) -> dict:
        async for piece in self.answer.pieces():
            self.name_items(self.blocks.add(piece))
        self.name_items(self.blocks.finish())
        return self.response()

    async def events(self) -> AsyncIterator[str]:
        """The documented event stream; it ends with response.completed even when the answer was cut short
        (its status then says "incomplete"), the event clients wait for."""
        yield self.event("response.created", response=self.response(finished=False))
        yield self.event("response.in_progress", response=self.response(finished=False))
        try:
            async for piece in self.answer.pieces():
                for change in self.blocks.add(piece):
                    for event in self.changed(change):
                        yield event
            for change in self.blocks.finish():
                for event in self.changed(change):
                    yield event
        except APIError as e:
            yield self.event("error", code=e.code, message=e.message, param=e.param)
            failed = {"status": "failed", "error": {"code": "server_error", "message": e.message}}
            yield self.event("response.failed", response=self.response(finished=False) | failed)
            return
        yield self.event("response.completed", response=self.response())

    def name_items(self, changes: list[Change]) -> None:
        for change in changes:
            if change.what == "start":
                self.item_ids.append(f"{ITEM_PREFIXES[change.block.kind]}_{uuid.uuid4().hex}")

    def changed(self, change: Change) -> list[str]:
        """The events of one change to a block."""
        self.name_items([change])
        block, where = change.block, {"output_index": change.block.position}
        call = {"item_id": self.item_ids[block.position], **where}  # where a function call's events point
        part = {**call, "content_index": 0}  # where a message's or reasoning's text events point
        if change.what == "start":
            added = [self.event("response.output_item.added", **where, item=self.item(block, done=False))]
            if block.kind != "tool_call":
                added.append(self.event("response.content_part.added", **part, part=content_part(block.kind, "")))
            return added
        if change.what == "delta":
            if block.kind == "tool_call":
                return [self.event("response.function_call_arguments.delta", **call, delta=change.text)]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **part, delta=change.text)]
            return [self.event("response.output_text.delta", **part, delta=change.text, logprobs=[])]
        if block.kind == "tool_call":
            done = [self.event("response.function_call_arguments.done", **call, name=block.name, arguments=block.text)]
        else:
            if block.kind == "reasoning":
                done = [self.event("response.reasoning_text.done", **part, text=block.text)]
            else:
                done = [self.event("response.output_text.done", **part, text=block.text, logprobs=[])]
            done.append(self.event("response.content_part.done", **part, part=content_part(block.kind, block.text)))
        return done + [self.event("response.output_item.done", **where, item=self.item(block))]

    def event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return server_sent(event)

    def item(self, block: Block, done: bool = True) -> dict:
        """The output item of `block`: as it starts (empty, in progress) or once it is done."""
        item_id, status = self.item_ids[block.position], "completed" if done else "in_progress"
        if block.kind == "tool_call":
            arguments = block.text if done else ""
            return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                    "arguments": arguments, "status": status}  # fmt: skip
        content = [content_part(block.kind, block.text)] if done else []
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    def response(self, finished: bool = True) -> dict:
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": self.model_name,
            "output": [],
            "usage": None,
            **self.echo,
        }
        if not finished:
            return response
        cut = self.blocks.finish_reason == "length"
        usage = self.answer.usage()
        return response | {
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "completed_at": int(time.time()),
            "output": [self.item(block) for block in self.blocks.blocks],
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.blocks.reasoning_tokens},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
        }


def content_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}
