"""What runs at each engine step, decided without the model: the waiting queue, admission, prefill groups and chunks.

`Scheduler.schedule(rows)` returns a `Plan`: which of the batch's rows go on and which leave, the waiting sequences
it admits (grouped to prefill together or alone), and the chunk of a long prompt fed this step. The runner executes
the plan on the model; the scheduler reads only a sequence's prompt and state (`Schedulable`) and handles caches as
opaque values: where one comes from (the prompt cache, a conversation, a fresh one) and whether it can be trimmed
are callables the engine gives it.
"""

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import QueueFullError

# Prompt tokens a prefill group may spend beyond what its members need (re-fed cached tokens, padding):
# about what one more forward pass costs in overhead on a small model.
WASTED_TOKENS = 32

Cache = Any  # one sequence's cache, a list of layers; the scheduler only hands it on


class Schedulable(Protocol):
    """What the scheduler reads of a sequence (`Generation` is one)."""

    cached_tokens: int  # prompt tokens its cache already holds, set at admission

    @property
    def prompt(self) -> list[int]: ...

    @property
    def continued(self) -> bool:
        """Whether it continues a conversation (its cache came with the request; its prompt lacks the cached part)."""

    @property
    def reads_images(self) -> bool:
        """Whether its prompt holds images: it prefills alone and unchunked (an image is read in one first pass, and
        a group could re-feed its cached places as plain tokens)."""

    @property
    def cancelled(self) -> bool: ...

    @property
    def going_on(self) -> bool:
        """Whether it wants another step: neither finished, cancelled, nor at its token budget."""


@dataclass
class Prefill:
    """Sequences that prefill in one pass, each with its cache; a lone one from prompt token `start` (by default its
    cached tokens: a long prompt's last chunk starts where its earlier chunks ended)."""

    members: list[tuple[Schedulable, Cache]]
    start: int | None = None


@dataclass
class Chunk:
    """`count` prompt tokens of a long prompt, from token `start`, fed into its cache this step."""

    sequence: Schedulable
    cache: Cache
    start: int
    count: int


@dataclass
class Plan:
    """One step: rows of the batch that go on and leave (indices), long prompts dropped while prefilling (cancelled:
    each with its cache and the prompt tokens fed), a chunk fed, and the prefills whose first tokens join the batch,
    in order."""

    going_on: list[int] = field(default_factory=list)
    leaving: list[int] = field(default_factory=list)
    dropped: list[tuple[Schedulable, Cache, int]] = field(default_factory=list)
    chunk: Chunk | None = None
    prefills: list[Prefill] = field(default_factory=list)


class Scheduler:
    """The queue of sequences waiting to join, and the choice of what each step runs.

    At most `max_batch` sequences are admitted at once (decoding, or prefilling a long prompt); up to `max_queue`
    more wait (QueueFullError beyond). A prompt that needs more than `prefill_step` tokens is fed a chunk per step
    (so that a running batch waits one chunk's pass for its next token, and a cancel is seen between chunks). `lookup`
    gives a newly admitted sequence its cache and the prompt tokens it holds; `keeps(cache, tokens)` says whether a
    cache can be trimmed back to its first `tokens` (a group re-feeds what its neediest member needs).

    `submit` and `cancel` may be called from other threads; `schedule` from the one that steps.
    """

    def __init__(
        self,
        max_batch: int,
        max_queue: int | None,
        prefill_step: int,
        lookup: Callable[[Schedulable], tuple[int, Cache]],
        keeps: Callable[[Cache, int], bool],
    ):
        self.max_batch, self.max_queue, self.prefill_step = max_batch, max_queue, prefill_step
        self.lookup, self.keeps = lookup, keeps
        self.waiting: deque[Schedulable] = deque()
        # long prompts admitted, each (sequence, its cache, prompt tokens fed so far): one chunk of the first is fed
        # per step, between the batch's decode steps
        self.prefilling: deque[tuple[Schedulable, Cache, int]] = deque()
        self.admitted: set[Schedulable] = set()  # taken from the queue and not yet left: prefilling or in a row
        self.lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling)

    def submit(self, sequence: Schedulable) -> None:
        with self.lock:
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self.waiting)} requests are already waiting; try again later")
            self.waiting.append(sequence)

    def cancel(self, sequence: Schedulable) -> None:
        """Take a cancelled sequence out of the queue at once (a running one leaves at the next `schedule`)."""
        with self.lock:
            if sequence in self.waiting:
                self.waiting.remove(sequence)

    def left(self, sequence: Schedulable) -> None:
        """`sequence` has left the batch (or ended with its first token): its place is free."""
        self.admitted.discard(sequence)

    def clear(self) -> None:
        with self.lock:
            self.waiting.clear()
        self.prefilling.clear()
        self.admitted.clear()

    def schedule(self, rows: list[Schedulable], release: Callable[[list[int]], None] | None = None) -> Plan:
        """The plan of the next step over the batch's `rows`. `release` gets the leaving rows before the queue is
        read, so that a joiner finds in the prompt cache what a leaver just stored."""
        plan = Plan()
        for i, sequence in enumerate(rows):
            (plan.going_on if sequence.going_on else plan.leaving).append(i)
        if release is not None:
            release(plan.leaving)
        joiners = self.admit(len(plan.going_on))
        long = [j for j in joiners if self.needs(j) > self.prefill_step and not j[0].reads_images]
        self.prefilling += [(s, cache, s.cached_tokens) for s, cache in long]
        joiners = [j for j in joiners if j not in long]
        self.next_chunk(plan)
        plan.prefills += [Prefill(group) for group in self.groups(joiners)]
        return plan

    def admit(self, running: int) -> list[tuple[Schedulable, Cache]]:
        """Waiting sequences taken while there is room, each with its cache (`lookup`)."""
        joiners = []
        while running + len(self.prefilling) + len(joiners) < self.max_batch:
            with self.lock:
                if not self.waiting:
                    break
                sequence = self.waiting.popleft()
            if sequence.cancelled:
                continue
            self.admitted.add(sequence)
            sequence.cached_tokens, cache = self.lookup(sequence)
            joiners.append((sequence, cache))
        return joiners

    def next_chunk(self, plan: Plan) -> None:
        """Into `plan`: the cancelled long prompts at the head of the line (dropped), then the first one's next chunk,
        or, once what is left fits in one, its last (a prefill of its own, whose first token joins the batch)."""
        while self.prefilling and self.prefilling[0][0].cancelled:
            sequence, cache, fed = self.prefilling.popleft()
            self.admitted.discard(sequence)
            plan.dropped.append((sequence, cache, fed))
        if not self.prefilling:
            return
        sequence, cache, fed = self.prefilling[0]
        if len(sequence.prompt) - fed > self.prefill_step:
            plan.chunk = Chunk(sequence, cache, fed, self.prefill_step)
            self.prefilling[0] = (sequence, cache, fed + self.prefill_step)
            return
        self.prefilling.popleft()
        plan.prefills.append(Prefill([(sequence, cache)], fed))

    @staticmethod
    def needs(joiner: tuple[Schedulable, Cache]) -> int:
        return len(joiner[0].prompt) - joiner[0].cached_tokens

    def groups(self, joiners: list[tuple[Schedulable, Cache]]) -> list[list[tuple[Schedulable, Cache]]]:
        """Joiners in groups to prefill together, by how many prompt tokens each still needs.

        A group feeds each member as many tokens as the neediest, re-feeding cached ones (or padding): it grows
        while that costs at most WASTED_TOKENS more than the members need, or a quarter more. A continued
        conversation (whose prompt lacks its cached tokens) prefills alone, as do a prompt holding images and one
        longer than a prefill chunk.
        """

        def joins(group, joiner):
            tokens, members = self.needs(joiner), group + [joiner]
            useful = sum(map(self.needs, members))
            return (
                not any(s.continued or s.reads_images for s, _ in members)
                and tokens <= self.prefill_step
                and len(members) * tokens - useful <= max(WASTED_TOKENS, useful // 4)
                and all(self.keeps(cache, max(0, len(s.prompt) - tokens)) for s, cache in members)
            )

        groups = []
        for joiner in sorted(joiners, key=self.needs):  # a group's neediest member is its last
            if groups and joins(groups[-1], joiner):
                groups[-1].append(joiner)
            else:
                groups.append([joiner])
        return groups
