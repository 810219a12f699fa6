"""OpenAI's Responses API (`POST /v1/responses`), stateless: every request carries its whole conversation.

`input` (a string, or message, function_call and function_call_output items) and `instructions` become a `Turn`'s
chat messages; function tools, `tool_choice` and `text.format` its tools and constraint. The answer comes back as
output items (reasoning, message, function calls), whole or as the documented stream of events.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..decode.grammar import Constraint
from ..errors import InvalidSettingError
from .blocks import KEEP_ALIVE_COMMENT, Block, Blocks, Change, server_sent
from .fields import (
    APIError,
    Body,
    bad,
    check_body,
    check_schema_size,
    effort_variable,
    flag,
    ignore_unread,
    integer,
    number,
    optional,
    text_field,
)
from .hangups import until_disconnected
from .images import IMAGE_PLACE, image_part
from .turns import Turn

if TYPE_CHECKING:
    from .answer import Answer
    from .protocol import TurnServer

MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")  # reasoning items' too
ITEM_PREFIXES = {"reasoning": "rs", "content": "msg", "tool_call": "fc"}
UNSTORED = ("previous_response_id", "conversation")  # what a stateful server would look up
# tools OpenAI's servers run (a local model cannot search the web or run OpenAI's containers): left out, logged
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "computer_use", "image_generation", "mcp", "local_shell", "custom", "tool_search")  # fmt: skip
IGNORED_ITEMS = ("web_search_call", "file_search_call", "code_interpreter_call", "computer_call",
                 "computer_call_output", "image_generation_call", "mcp_call", "mcp_list_tools", "local_shell_call",
                 "local_shell_call_output", "custom_tool_call", "custom_tool_call_output", "item_reference",
                 "compaction", "tool_search_call", "tool_search_output")  # fmt: skip


def routes(server: "TurnServer") -> list[Route]:
    async def create(request: HTTPRequest):
        body = await server.read(request)
        turn, echo, namespaces = read_request(body)
        stream = flag(body, "stream")
        ignore_unread(body, "responses")
        model = await server.model(body)
        answer = await model.start(turn)
        reply, headers = Reply(model.name, echo, answer, namespaces), answer.headers(body)
        if stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream", headers=headers)
        return JSONResponse(await until_disconnected(request, reply.whole()), headers=headers)

    return [Route("/v1/responses", create, methods=["POST"])]


# ---- the request ----


def read_request(body: Body) -> tuple[Turn, dict, dict[str, str]]:
    """The body's Turn, the request fields the response repeats back, and the namespace of each function that
    came inside a namespace tool (which its calls name back)."""
    body = body if isinstance(body, Body) else Body(body)
    check_body(body, "responses")
    for name in UNSTORED:
        if body.get(name) is not None:
            raise bad(name, f"'{name}' is not supported: this server stores nothing; send the whole conversation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "'instructions' must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    images = []
    messages += input_messages(body.get("input"), body, images)
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list of function tools")
    functions, namespaces = function_tools(tools, body)
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
        tools=functions or None,
        tool_choice=tool_choice(choice),
        parallel_tool_calls=body.get("parallel_tool_calls") is None or flag(body, "parallel_tool_calls"),
        constraint=constraint(text_format),
        settings=settings,
        template_kwargs=effort_variable(body, "reasoning", "responses"),
        cache_key=optional(body, "prompt_cache_key", str, "a string"),
        messages_param="input",
        params={"max_tokens": "max_output_tokens"},
        images=images,
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
    return turn, echo, namespaces


def function_tools(tools: list, body: Body) -> tuple[list[dict], dict[str, str]]:
    """The request's function tools in the chat shape, a namespace tool's functions among them (Codex groups
    tools that way), and each such function's namespace; tools OpenAI's servers run are left out (logged)."""
    functions, namespaces = [], {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad(f"tools[{i}].tools", f"tools[{i}] is a namespace tool; its 'tools' must be a list")
            for j, function in enumerate(inner):
                functions.append(chat_tool(function, f"tools[{i}].tools[{j}]"))
                namespaces[functions[-1]["function"]["name"]] = text_field(tool, "name", f"tools[{i}]")
        elif kind in HOSTED_TOOLS:
            body.ignore(f"tools[].type={kind}", "responses")
        else:
            functions.append(chat_tool(tool, f"tools[{i}]"))
    return functions, namespaces


def input_messages(items, body: Body, images: list) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds messages and the function calls and
    outputs of earlier turns (an assistant's calls join its message, as a chat's tool_calls do). A call cut short
    by the answer's limit (`"status": "incomplete"`, its arguments not whole JSON) is taken as it was written; items
    of hosted tools this server does not run (web search calls, ...) are left out. A user's input_image parts are
    marked in its text, their bytes appended to `images`."""
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
            content = message_text(item.get("content"), f"{param}.content", images if role == "user" else None)
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
            if item.get("status") == "incomplete":
                call["status"] = "incomplete"
            if last is None:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = message_text(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": text_field(item, "call_id", param), "content": output})
        elif kind in IGNORED_ITEMS:
            body.ignore(f"input[].type={kind}", "responses")
        else:
            message = f"{param} is a '{kind}' item; this server reads message, function_call and function_call_output"
            raise bad(f"{param}.type", message)
    return messages


def message_text(content, param: str, images: list | None = None) -> str:
    """A message's text: a string, or a list of input_text/output_text (or reasoning/summary text) parts, and with
    `images` input_image parts (their places marked, their bytes appended)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(param, f"'{param}' must be a string or a list of input_text parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images is not None:
            images.append(image_part(part, f"{param}[{i}]"))
            texts.append(IMAGE_PLACE)
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{param}[{i}]", f"{kind} input is not supported here; send text")
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

    def __init__(self, model_name: str, echo: dict, answer: "Answer", namespaces: dict[str, str] | None = None):
        self.model_name, self.echo, self.answer = model_name, echo, answer
        self.namespaces = namespaces or {}  # a namespaced function's name -> its namespace, named in its calls
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
        """The documented event stream: it ends with response.completed, or response.incomplete when the answer
        was cut at its token limit (the item being written then has status "incomplete"). While a long prompt is
        read, a keep-alive comment goes out every few seconds."""
        yield self.event("response.created", response=self.response(finished=False))
        yield self.event("response.in_progress", response=self.response(finished=False))
        try:
            async for piece in self.answer.pieces(heartbeat=True):
                if piece is None:
                    yield KEEP_ALIVE_COMMENT
                    continue
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
        ended = self.response()
        yield self.event(f"response.{ended['status']}", response=ended)

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
        """The output item of `block`: as it starts (empty, in progress) or once it is done; "incomplete" when the
        answer's token limit cut it (the last block of a cut answer, but a call whose arguments are whole)."""
        item_id, status = self.item_ids[block.position], "completed" if done else "in_progress"
        if done and self.cut_short(block):
            status = "incomplete"
        if block.kind == "tool_call":
            arguments = block.text if done else ""
            item = {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                    "arguments": arguments, "status": status}  # fmt: skip
            if block.name in self.namespaces:
                item["namespace"] = self.namespaces[block.name]
            return item
        content = [content_part(block.kind, block.text)] if done else []
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    def cut_short(self, block: Block) -> bool:
        """Whether the answer's token limit ended it inside `block`."""
        if self.blocks.finish_reason != "length" or block is not self.blocks.blocks[-1]:
            return False
        return block.kind != "tool_call" or not whole_object(block.text)

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


def whole_object(text: str) -> bool:
    """Whether `text` is a whole JSON object (a call's arguments written to their end)."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def content_part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}
