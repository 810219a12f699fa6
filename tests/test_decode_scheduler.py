"""decode/scheduler.py without a model: fake sequences and caches through admission, grouping, chunking and leaving."""

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from minimlx.decode import scheduler as scheduler_module
from minimlx.decode.scheduler import WASTED_TOKENS, Chunk, Prefill, Scheduler
from minimlx.errors import QueueFullError


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it."""

    prompt: list[int]
    continued: bool = False
    reads_images: bool = False
    cancelled: bool = False
    going_on: bool = True
    cached_tokens: int = 0


@dataclass(eq=False)
class Cache:
    """A sequence's cache: the prompt tokens it holds, and whether it can be trimmed back (a window cannot)."""

    held: int = 0
    trimmable: bool = True


@dataclass
class Lookups:
    """The engine's prompt cache, faked: a prompt's cached start by its first token; every lookup recorded."""

    cached: dict[int, int] = field(default_factory=dict)
    log: list = field(default_factory=list)

    def __call__(self, sequence: Sequence) -> tuple[int, Cache]:
        self.log.append(sequence)
        held = self.cached.get(sequence.prompt[0], 0)
        return held, Cache(held)


def keeps(cache: Cache, tokens: int) -> bool:
    return cache.trimmable or tokens >= cache.held


def make(max_batch=8, max_queue=None, prefill_step=64, lookup=None) -> Scheduler:
    return Scheduler(max_batch, max_queue, prefill_step, lookup or Lookups(), keeps)


def prompt(n: int, first: int = 1) -> list[int]:
    return [first] + [7] * (n - 1)


def members(prefill: Prefill) -> list[int]:
    return [len(s.prompt) - s.cached_tokens for s, _ in prefill.members]


def test_the_scheduler_imports_no_model_no_mlx_and_no_tokenizer():
    tree = ast.parse(Path(scheduler_module.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"threading", "collections", "collections.abc", "dataclasses", "typing", "..errors"}


def test_joiners_of_about_one_length_prefill_together_neediest_last():
    s = make()
    sequences = [Sequence(prompt(n)) for n in (12, 10, 11, 9)]
    for seq in sequences:
        s.submit(seq)
    plan = s.schedule([])
    assert [members(p) for p in plan.prefills] == [[9, 10, 11, 12]]
    assert plan.chunk is None and plan.going_on == plan.leaving == []
    assert s.admitted == set(sequences) and not s.waiting


def test_a_group_grows_while_it_wastes_at_most_wasted_tokens_or_a_quarter():
    s = make(prefill_step=512)
    for n in (1, 40, 10, 41, 300, 370):
        s.submit(Sequence(prompt(n)))
    plan = s.schedule([])
    # 1 and 10 fit (9 wasted); 40 with them would waste 2 * 40 + 40 - 51 > WASTED_TOKENS; 41 joins 40 (1 wasted);
    # 370 with 300 wastes 70, under a quarter of 670
    assert [members(p) for p in plan.prefills] == [[1, 10], [40, 41], [300, 370]]
    assert 3 * 40 - (1 + 10 + 40) > WASTED_TOKENS


def test_a_continued_conversation_and_an_untrimmable_cache_prefill_alone():
    lookup = Lookups(cached={5: 6})  # the prompt cache holds 6 tokens of the prompts that start with 5

    def untrimmable(sequence):
        held, cache = lookup(sequence)
        return held, Cache(held, trimmable=sequence.prompt[0] != 5)

    s = Scheduler(8, None, 64, untrimmable, keeps)
    windowed = Sequence(prompt(10, first=5))  # needs 4, but a group with needier members would trim its cache back
    plain = [Sequence(prompt(8)), Sequence(prompt(9))]
    conversation = Sequence(prompt(10), continued=True)  # would cost 3 wasted tokens in their group
    for seq in (conversation, windowed, *plain):
        s.submit(seq)
    groups = [[seq for seq, _ in p.members] for p in s.schedule([]).prefills]
    assert windowed.cached_tokens == 6
    assert groups == [[windowed], plain, [conversation]]


def test_admission_fills_the_batch_and_the_rest_wait():
    s = make(max_batch=4)
    sequences = [Sequence(prompt(5)) for _ in range(6)]
    for seq in sequences:
        s.submit(seq)
    rows = [Sequence(prompt(3)) for _ in range(2)]
    plan = s.schedule(rows)
    assert plan.going_on == [0, 1] and sum(map(members, plan.prefills), []) == [5, 5]
    assert list(s.waiting) == sequences[2:] and s.busy
    rows[0].going_on = False  # it finished: its place goes to the next in line
    plan = s.schedule(rows + [seq for p in plan.prefills for seq, _ in p.members])
    assert plan.leaving == [0] and plan.going_on == [1, 2, 3]
    assert [seq for p in plan.prefills for seq, _ in p.members] == [sequences[2]]


def test_a_full_queue_refuses_a_request():
    s = make(max_queue=2)
    s.submit(Sequence(prompt(3)))
    s.submit(Sequence(prompt(3)))
    with pytest.raises(QueueFullError, match="2 requests are already waiting"):
        s.submit(Sequence(prompt(3)))
    s.schedule([])  # both admitted: the queue has room again
    s.submit(Sequence(prompt(3)))
    assert len(s.waiting) == 1


def test_a_request_cancelled_while_waiting_holds_no_place():
    s = make(max_batch=1)
    first, second, third = (Sequence(prompt(3)) for _ in range(3))
    for seq in (first, second, third):
        s.submit(seq)
    first.cancelled = True
    s.cancel(first)
    second.cancelled = True  # cancelled but still queued: skipped at admission
    assert list(s.waiting) == [second, third]
    plan = s.schedule([])
    assert [seq for seq, _ in plan.prefills[0].members] == [third] and s.admitted == {third} and not s.waiting


def test_a_long_prompt_is_fed_a_chunk_a_step_and_its_last_chunk_prefills():
    s = make(prefill_step=16)
    long, short = Sequence(prompt(40)), Sequence(prompt(4))
    s.submit(long)
    s.submit(short)
    plan = s.schedule([])
    assert plan.chunk == Chunk(long, plan.chunk.cache, 0, 16) and [members(p) for p in plan.prefills] == [[4]]
    plan = s.schedule([short])
    assert plan.going_on == [0] and (plan.chunk.start, plan.chunk.count) == (16, 16) and not plan.prefills
    plan = s.schedule([short])
    assert plan.chunk is None and len(plan.prefills) == 1
    assert plan.prefills[0].members[0][0] is long and plan.prefills[0].start == 32
    assert not s.prefilling and not s.busy


def test_a_cached_start_shortens_a_long_prompt_to_one_prefill():
    s = make(prefill_step=16, lookup=Lookups(cached={3: 30}))
    seq = Sequence(prompt(40, first=3))
    s.submit(seq)
    plan = s.schedule([])
    assert plan.chunk is None and members(plan.prefills[0]) == [10] and plan.prefills[0].start is None


def test_a_prompt_holding_images_prefills_alone_and_whole():
    """Its images are read in one first pass: never a chunk, never in a group (which could re-feed its images'
    cached places as plain tokens)."""
    s = make(prefill_step=16)
    pictured, plain = Sequence(prompt(40), reads_images=True), [Sequence(prompt(8)), Sequence(prompt(8))]
    small = Sequence(prompt(8), reads_images=True)
    for seq in (pictured, small, *plain):
        s.submit(seq)
    plan = s.schedule([])
    assert plan.chunk is None and not s.prefilling
    assert sorted(map(members, plan.prefills)) == [[8], [8, 8], [40]]


def test_a_prompt_cancelled_mid_chunk_is_dropped_with_what_it_fed():
    s = make(max_batch=2, prefill_step=16)
    long = Sequence(prompt(50))
    s.submit(long)
    cache = s.schedule([]).chunk.cache
    s.schedule([])
    long.cancelled = True
    waiting = Sequence(prompt(3))
    s.submit(waiting)
    plan = s.schedule([])
    assert plan.dropped == [(long, cache, 32)] and plan.chunk is None
    assert long not in s.admitted and [seq for seq, _ in plan.prefills[0].members] == [waiting]


def test_prefilling_prompts_count_against_the_batch():
    s = make(max_batch=2, prefill_step=8)
    long = [Sequence(prompt(30)) for _ in range(2)]
    for seq in long + [Sequence(prompt(3))]:
        s.submit(seq)
    plan = s.schedule([])
    assert plan.chunk.sequence is long[0] and not plan.prefills and len(s.waiting) == 1
    assert [seq for seq, _, _ in s.prefilling] == long


def test_leaving_rows_are_released_before_the_queue_is_read():
    lookup = Lookups()
    s = make(lookup=lookup)
    rows = [Sequence(prompt(3)), Sequence(prompt(3), going_on=False), Sequence(prompt(3))]
    rows[2].cancelled, rows[2].going_on = True, False
    s.submit(Sequence(prompt(4)))
    order = []
    plan = s.schedule(rows, lambda leaving: order.append(("release", leaving, len(lookup.log))))
    assert plan.going_on == [0] and plan.leaving == [1, 2]
    assert order == [("release", [1, 2], 0)] and len(lookup.log) == 1


def test_left_frees_a_place_and_clear_drops_everything():
    s = make(max_batch=1)
    first, second = Sequence(prompt(3)), Sequence(prompt(3))
    s.submit(first)
    s.submit(second)
    s.schedule([])
    assert s.admitted == {first}
    s.left(first)
    assert not s.admitted
    s.clear()
    assert not s.busy and not s.waiting and not s.admitted
