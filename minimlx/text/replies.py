"""An assistant's generated text split into what clients read apart: content, reasoning and tool calls."""

from dataclasses import dataclass


@dataclass
class Delta:
    """A piece of one reply, in the order the model wrote it.

    `kind` is "content" (answer text), "reasoning" (thinking text), "tool_call" (a call starts: `index` counts the
    reply's calls from 0, `id` and `name` are set) or "arguments" (`text` is a fragment of call `index`'s JSON
    arguments; the fragments of one call join to its whole arguments).
    """

    kind: str
    text: str = ""
    index: int = 0
    name: str | None = None
    id: str | None = None
