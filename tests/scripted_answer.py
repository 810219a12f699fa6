"""A stand-in for the server's Answer that yields scripted Pieces, so the Responses and Messages endpoints' shapes
are tested without a model; and the reading of their server-sent events."""

import asyncio
import json

from minimlx.server.fields import APIError
from minimlx.server.turns import Piece, Usage
from minimlx.text.replies import Delta


class ScriptedAnswer:
    def __init__(self, pieces: list[Piece], usage: Usage, failure: APIError | None = None):
        self.scripted, self.failure, self.final = pieces, failure, usage
        self.prompt_tokens = usage.prompt_tokens

    async def pieces(self, heartbeat: bool = False):
        """The scripted pieces; a None among them stands for a heartbeat (a long silence), passed on only to a
        consumer that asked for heartbeats, as the server's Answer does."""
        for piece in self.scripted:
            if piece is not None or heartbeat:
                yield piece
        if self.failure is not None:
            raise self.failure

    def usage(self) -> Usage:
        return self.final


def text(kind: str, *fragments: str) -> list[Piece]:
    """One piece per fragment of `kind` ("content" or "reasoning") text."""
    return [Piece(0, [Delta(kind, fragment)]) for fragment in fragments]


def call(index: int, call_id: str, name: str, *fragments: str) -> list[Piece]:
    """A tool call: its start, then one piece per fragment of its JSON arguments."""
    start = Piece(0, [Delta("tool_call", index=index, id=call_id, name=name)])
    return [start] + [Piece(0, [Delta("arguments", fragment, index=index)]) for fragment in fragments]


def end(reason: str, stop_string: str | None = None) -> list[Piece]:
    return [Piece(0, [], finish_reason=reason, stop_string=stop_string)]


# A reply that thinks, says something, then calls a tool.
THOUGHT_ANSWER_AND_CALL = (
    text("reasoning", "Think", "ing.")
    + text("content", "Let me ", "check.")
    + call(0, "call_9", "get_weather", '{"city": ', '"Paris"}')
    + end("tool_calls")
)


def collect(events) -> list[dict]:
    """The data of each server-sent event of an async stream, after checking that the event is named by its type."""

    async def gather():
        return [chunk async for chunk in events]

    parsed = []
    for chunk in asyncio.run(gather()):
        if chunk.startswith(":"):  # a comment (keep-alive): clients skip it
            continue
        name, data = chunk.removesuffix("\n\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        parsed.append(event)
    return parsed
