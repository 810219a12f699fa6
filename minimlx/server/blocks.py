"""What the Responses and Messages endpoints share: an answer's pieces grouped into blocks, and the named
server-sent events both stream them as.

Both APIs show an answer as a list of blocks (Responses' output items, Messages' content blocks): reasoning, text,
and one per tool call, in the order the model wrote them. Whole answers and streamed ones are built from the same
`Blocks`, so a stream always adds up to the answer it would have been.
"""

import json
from dataclasses import dataclass

from .turns import Piece


@dataclass
class Block:
    """One block of an answer: `kind` "reasoning", "content" or "tool_call", `position` its place among the
    answer's blocks; `text` the reasoning, the answer text or a call's JSON arguments; a call's `name` and
    `call_id`."""

    kind: str
    position: int
    text: str = ""
    name: str | None = None
    call_id: str | None = None


@dataclass
class Change:
    """What one piece did to a block: "start" it, add `text` to it ("delta"), or "stop" it."""

    what: str
    block: Block
    text: str = ""


class Blocks:
    """An answer's blocks as its pieces arrive (one choice: these APIs answer once per request)."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.calls: dict[int, Block] = {}  # a call's index in the reply -> its block
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.reasoning_tokens = 0

    def add(self, piece: Piece) -> list[Change]:
        changes = []
        for delta in piece.deltas:
            if delta.kind == "tool_call":
                changes += self.start(Block("tool_call", len(self.blocks), name=delta.name, call_id=delta.id))
                self.calls[delta.index] = self.open
            elif delta.kind == "arguments":
                block = self.calls[delta.index]
                block.text += delta.text
                changes.append(Change("delta", block, delta.text))
            elif delta.text:
                if self.open is None or self.open.kind != delta.kind:
                    changes += self.start(Block(delta.kind, len(self.blocks)))
                self.open.text += delta.text
                changes.append(Change("delta", self.open, delta.text))
        self.reasoning_tokens += any(delta.kind == "reasoning" for delta in piece.deltas)
        if piece.finish_reason is not None:
            self.finish_reason, self.stop_string = piece.finish_reason, piece.stop_string
        return changes

    def finish(self) -> list[Change]:
        """Close the last block. An answer with neither text nor a tool call still gets one empty text block, so a
        client that reads the answer's first text finds it."""
        changes = self.close()
        if not any(block.kind != "reasoning" for block in self.blocks):
            changes += self.start(Block("content", len(self.blocks))) + self.close()
        return changes

    def start(self, block: Block) -> list[Change]:
        changes = self.close()
        self.blocks.append(block)
        self.open = block
        return changes + [Change("start", block)]

    def close(self) -> list[Change]:
        block, self.open = self.open, None
        return [] if block is None else [Change("stop", block)]


KEEP_ALIVE_COMMENT = ": keep-alive\n\n"  # a server-sent events comment: clients skip it, the connection stays open


def server_sent(event: dict) -> str:
    """`event` as a named server-sent event: both APIs name each event by its "type"."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
