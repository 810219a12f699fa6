"""The running choices of one turn, as the endpoints read them: the engine's outputs as Pieces."""

import time
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ..decode import Generation, Output
from ..text.replies import Delta, ReplyParser
from .fields import Body
from .turns import Piece, Usage

if TYPE_CHECKING:
    import asyncio

    from .bridge import EngineBridge
    from .rendering import Renderer

CAPPED_HEADER = "x-minimlx-max-tokens"  # the answer's token limit, sent when it is below what the request asked


class Answer:
    """The running choices of one turn: the engine's outputs as Pieces (deltas, logprobs, finish reasons)."""

    def __init__(
        self,
        bridge: "EngineBridge",
        renderer: "Renderer",
        generations: list[Generation],
        queue: "asyncio.Queue",
        heartbeat: float,
    ):
        self.bridge, self.renderer, self.generations, self.queue = bridge, renderer, generations, queue
        self.heartbeat = heartbeat  # seconds of silence after which `pieces(heartbeat=True)` yields None
        # an answer dropped unread (its response never sent: the client left first) stops its generations
        weakref.finalize(self, bridge.dropped.append, generations)
        self.index = {generation: i for i, generation in enumerate(generations)}
        self.parsers: list[ReplyParser] | None = None  # a chat's; a raw prompt's text is content alone
        self.called = [False] * len(generations)
        self.capped: tuple[int, int] | None = None  # (max_tokens asked, max_tokens given) when the room left capped it
        self.first_output_at: float | None = None  # time.monotonic() of the first token out
        self.token_gaps: list[float] = []  # seconds between one output and the next (the metrics' inter-token latency)

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
        every = self.heartbeat if heartbeat else None
        async for output in self.bridge.outputs(self.generations, self.queue, every):
            if output is None:
                yield None
                continue
            now = time.monotonic()
            if self.first_output_at is None:
                self.first_output_at = now
            else:
                self.token_gaps.append(now - self.last_output_at)
            self.last_output_at = now
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
            logprob = self.renderer.token_logprob(output.token, output.logprob, output.top_logprobs)
        return Piece(i, deltas, logprob, finish, generation.stop_string if finish else None)

    def usage(self) -> Usage:
        def answered(g: Generation) -> int:  # the stop token ending an answer is not part of it
            return len(g.tokens) - (bool(g.tokens) and g.tokens[-1] in g.stop_ids)

        completion = sum(answered(g) for g in self.generations)
        return Usage(self.prompt_tokens, completion, self.generations[0].cached_tokens)
