"""`Mirrored`: `serve`'s engine on every rank, which keeps all ranks stepping the same batch."""

import json
import threading

import mlx.core as mx
import numpy as np

from ..decode import Engine, Generation, Output, Request, SamplingSettings
from ..decode.grammar import Constraint
from .model import Distributed


def constraint_fields(constraint: Constraint | None) -> list[str] | None:
    return [constraint.kind, constraint.source] if constraint is not None else None


class Mirrored(Engine):
    """`serve`'s engine on every rank: all ranks take the same steps with the same sequences in them.

    Requests reach rank 0 only. At the start of each of its steps, rank 0 tells the others (one all_sum of the
    message's length, and of the message when there is one) which requests joined and which sequences were
    cancelled since its last step; the other ranks (`follow`) replay that, then step too. A step holds the
    engine's lock, so that nothing joins or leaves between what rank 0 announces and what it runs. The other
    ranks sample greedily: their tokens are replaced by rank 0's (`Distributed.agree`) anyway.
    """

    def __init__(self, model: Distributed, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.lock = threading.RLock()
        self.group, self.rank = model.group, model.rank
        self.joined: list[Generation] = []
        self.cancelled: list[int] = []
        self.sequences: list[Generation] = []  # every sequence submitted, by number

    def submit(self, request: Request) -> Generation:
        with self.lock:
            sequence = super().submit(request)
            self.joined.append(sequence)
            return sequence

    def cancel(self, sequence: Generation) -> None:
        with self.lock:
            super().cancel(sequence)
            self.cancelled.append(sequence)

    def step(self) -> list[Output]:
        with self.lock, self.step_guard():  # the announcement waits on the other ranks too
            joined, self.joined = self.joined, []
            cancelled, self.cancelled = self.cancelled, []
            news = [
                [
                    s.request.prompt,
                    s.request.settings.max_tokens,
                    s.seed,
                    list(s.request.settings.stop),
                    sorted(s.stop_ids),
                    constraint_fields(s.request.settings.constraint),
                ]
                for s in joined
            ]
            self.sequences += joined
            numbers = {id(s): n for n, s in enumerate(self.sequences)}
            self.announce(json.dumps([news, [numbers[id(s)] for s in cancelled]]) if news or cancelled else "")
            return super().step()

    def announce(self, message: str) -> str:
        """Rank 0's `message` on every rank ("" when it has nothing to say)."""
        data = np.frombuffer(message.encode(), dtype=np.uint8)
        size = mx.distributed.all_sum(mx.array(data.size if self.rank == 0 else 0), group=self.group).item()
        if size == 0:
            return ""
        mine = mx.array(data) if self.rank == 0 else mx.zeros((size,), mx.uint8)
        return bytes(np.array(mx.distributed.all_sum(mine, group=self.group))).decode()

    def follow(self) -> None:
        """The other ranks' side: replay rank 0's steps until it stops (then the next all_sum fails)."""
        while True:
            message = self.announce("")
            if message:
                news, cancelled = json.loads(message)
                for prompt, max_tokens, seed, stop, stop_ids, constraint in news:
                    # a grammar ends a sequence where its answer is complete: every rank must know it
                    constraint = Constraint(*constraint) if constraint else None
                    settings = SamplingSettings(max_tokens, seed=seed, stop=stop, constraint=constraint)
                    request = Request(prompt, settings, stop_ids=frozenset(stop_ids))
                    self.sequences.append(Engine.submit(self, request))
                for number in cancelled:
                    Engine.cancel(self, self.sequences[number])
            Engine.step(self)
