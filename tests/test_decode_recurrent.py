"""The decode engine on a model with recurrent layers (tests/hybrid_model.py: Gated DeltaNet beside attention, SmolLM2's
tokenizer), against transformers' greedy `generate`: prompts of several lengths alone and batched together (left
padding never enters a state), speculation (prompt lookup and a draft model: rejected drafts roll the state back by
snapshot), and the prompt cache (a conversation's next turn reuses the state; a prompt sharing only part of a cached
one restores the latest mark at or before the shared start; the cache folder keeps states and marks over a restart),
within its bytes; and the memory a recurrent layer holds, a constant whatever the length."""

import numpy as np
import pytest
from hybrid_model import hybrid_config, reference_greedy
from servers import Served

import minimlx
from minimlx.core.cache import MARKS, RecurrentCache
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.decode.prefill import prefill

pytestmark = pytest.mark.slow  # transformers' model and SmolLM2's tokenizer, built once a session
TOKENS = 10
STEP = 16  # prefill chunk: the marks a prompt leaves fall every STEP tokens


def prompt(length: int, seed: int, vocab: int = 49152) -> list[int]:
    return np.random.default_rng(seed).integers(100, vocab, length).tolist()


def answers(engine: Engine, prompts: list[list[int]], tokens: int = TOKENS) -> list:
    generations = [engine.submit(Request(list(p), SamplingSettings(temperature=0, max_tokens=tokens))) for p in prompts]
    engine.run()
    return generations


@pytest.fixture(scope="module")
def prompts(hybrid):
    _, torch_model, _, _ = hybrid
    made = [prompt(n, seed) for seed, n in enumerate((3, 11, 29, 75))]
    return made, [reference_greedy(torch_model, p, TOKENS) for p in made]


@pytest.mark.parametrize("max_batch", [1, 4])
def test_greedy_ids_equal_transformers_alone_and_batched(hybrid, prompts, max_batch):
    _, _, model, tokenizer = hybrid
    made, expected = prompts
    engine = Engine(model, tokenizer, max_batch=max_batch, prefill_step=STEP)
    assert [g.tokens for g in answers(engine, made)] == expected


def test_speculation_rolls_the_state_back(hybrid, tmp_path_factory):
    """Prompt lookup (the prompt opens with the start of its own answer, so the answer's first token finds drafts,
    some rejected) and a draft model of other random weights: the answers are transformers' greedy ones."""
    from hybrid_model import hybrid_model

    _, torch_model, model, tokenizer = hybrid
    start = prompt(30, 0)
    copying = reference_greedy(torch_model, start, 4) + start
    expected = reference_greedy(torch_model, copying, 16)
    lookup = answers(Engine(model, tokenizer, max_batch=1, prompt_lookup=3, prefill_step=STEP), [copying], 16)[0]
    assert lookup.tokens == expected and lookup.drafted > lookup.accepted > 0
    folder = tmp_path_factory.mktemp("draft")
    hybrid_model(folder, seed=1)
    draft, _ = minimlx.load(folder, dtype="float32")
    engine = Engine(model, tokenizer, max_batch=1, draft_model=draft, draft_tokens=3, prefill_step=STEP)
    drafted = answers(engine, [copying], 16)[0]
    assert drafted.tokens == expected and drafted.drafted > drafted.accepted


def conversation(torch_model, length: int = 60, shared: int = 40):
    """(a first prompt of `length` tokens, its answer, a second prompt extending both, a third sharing only the first's
    first `shared` tokens, their greedy answers)."""
    first = prompt(length, 11)
    answer = reference_greedy(torch_model, first, TOKENS)
    second = first + answer + prompt(9, 12)
    third = first[:shared] + prompt(7, 13)
    return first, answer, second, third, [reference_greedy(torch_model, p, TOKENS) for p in (second, third)]


def test_prompt_cache_reuses_a_state_whole_or_at_a_mark(hybrid):
    """The second prompt extends the first and its answer: all of those but the answer's last token (never fed) are
    reused. The third shares 40 tokens: the latest mark at or before them, 32 (a prefill chunk's end), is restored."""
    _, torch_model, model, tokenizer = hybrid
    first, answer, second, third, expected = conversation(torch_model)
    engine = Engine(model, tokenizer, prompt_cache_size=4, prompt_cache_bytes=2_000_000, prefill_step=STEP)
    assert answers(engine, [first])[0].tokens == answer
    extended, partial = answers(engine, [second]) + answers(engine, [third])
    assert (extended.cached_tokens, extended.tokens) == (len(first) + TOKENS - 1, expected[0])
    assert (partial.cached_tokens, partial.tokens) == (32, expected[1])
    held = sum(c.nbytes for _, cache in engine.prompt_cache.entries for c in cache)
    assert held <= 2_000_000


def test_batched_prompts_reuse_states_at_their_rows_marks(hybrid):
    """Four prompts prefilled and decoded together after a first one: each resumes from the cached state it can (the
    whole first prompt and answer, a mark at 32 or 48, nothing); sent again, each finds its own row's marks (its
    prompt but the last token, or the answer's end)."""
    _, torch_model, model, tokenizer = hybrid
    first, answer, second, third, expected = conversation(torch_model)
    others = [second, third, prompt(20, 14), first[:50] + prompt(3, 15)]
    expected = [*expected, *(reference_greedy(torch_model, p, TOKENS) for p in others[2:])]
    engine = Engine(model, tokenizer, max_batch=4, prompt_cache_size=4, prefill_step=STEP)
    assert answers(engine, [first])[0].tokens == answer
    together = answers(engine, others)
    assert [g.tokens for g in together] == expected and [g.cached_tokens for g in together] == [69, 32, 0, 48]
    again = answers(engine, others)
    assert [g.tokens for g in again] == expected and [g.cached_tokens for g in again] == [78, 46, 19, 52]


def test_prompt_cache_folder_keeps_states_and_marks(hybrid, tmp_path):
    _, torch_model, model, tokenizer = hybrid
    first, answer, second, third, expected = conversation(torch_model)
    options = dict(prompt_cache_size=4, prompt_cache_dir=str(tmp_path), prefill_step=STEP)
    engine = Engine(model, tokenizer, **options)
    answers(engine, [first])
    engine.prompt_cache.flush()
    restarted = Engine(model, tokenizer, **options)
    extended = answers(restarted, [second])[0]
    restarted.prompt_cache.flush()
    partial = answers(Engine(model, tokenizer, **options), [third])[0]
    assert (extended.cached_tokens, extended.tokens) == (len(first) + TOKENS - 1, expected[0])
    assert (partial.cached_tokens, partial.tokens) == (32, expected[1])


def test_memory_is_the_attention_cache_plus_a_constant_per_recurrent_layer(hybrid):
    """After 4,096 tokens (in prefill chunks, each leaving a mark) the attention layers hold their keys and values
    (within a growth step) and each recurrent layer its states and MARKS marks of them (the latest mark being the
    state itself): the same bytes after 6,144 tokens."""
    _, _, model, _ = hybrid
    config = hybrid_config(49152)
    ids = prompt(6144, 3)
    channels = 2 * 2 * 16 + 4 * 8  # the convolution's: queries, keys (2 heads of 16), values (4 heads of 8)
    state = (3 * channels + 4 * 16 * 8) * 4  # 3 columns of the conv's inputs, the delta rule's 4 x 16 x 8, float32
    column = 2 * config["num_key_value_heads"] * config["head_dim"] * 4  # a token's keys and values, float32
    for count in (4096, 6144):
        cache = model.make_cache()
        prefill(model, ids[:count], cache, 512)
        for c, kind in zip(cache, config["layer_types"]):
            if kind == "linear_attention":
                assert isinstance(c, RecurrentCache) and c.nbytes == MARKS * state
            else:
                assert count * column <= c.nbytes < (count + 256) * column


@pytest.mark.slow
def test_serve_reuses_states_across_requests_and_a_restart(hybrid, tmp_path):
    """Through `minimlx serve` (prefill chunks of 512 tokens): a second request extends the first (a cache hit), a
    third shares 540 tokens of it (the mark at 512 is restored), and a restarted server reads the states back."""
    folder, torch_model, _, tokenizer = hybrid
    first, answer, second, third, expected = conversation(torch_model, 600, 540)
    kept = str(tmp_path / "prompts")
    options = ("--model", str(folder), "--prompt-cache-dir", kept, "--dtype", "float32")

    def complete(server, ids):
        status, reply = server.post("/v1/completions", {"prompt": ids, "max_tokens": TOKENS, "temperature": 0})
        assert status == 200, reply
        return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    server = Served(*options)
    try:
        got = [complete(server, ids) for ids in (first, second, third)]
    finally:
        server.stop()
    assert server.process.wait(timeout=30) == 0, server.log()[-3000:]
    texts = [tokenizer.decode(ids) for ids in (answer, *expected)]
    assert got == list(zip(texts, [0, len(first) + TOKENS - 1, 512]))
    again = Served(*options)
    try:
        assert complete(again, second) == (texts[1], len(second) - 1)
    finally:
        again.stop()
