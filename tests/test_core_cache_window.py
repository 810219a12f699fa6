"""`max_kv_size`: a cache of the first 4 tokens (attention sinks) and a window of the latest. Within the bound it is
the plain cache; past it each token reads what mlx-lm's `RotatingKVCache(keep=4)` reads, and over a long
generation the cache's bytes stay those of the bound."""

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from command_line import one_line_error
from reference import relative_error, require

import minimlx
from minimlx.cli import main
from minimlx.core.cache import KVCache, SinkKVCache
from minimlx.decode import SamplingSettings, generate_tokens, make_cache
from minimlx.decode.engine import Engine, Generation, Request
from minimlx.errors import InvalidSettingError

IDS = [int(i) for i in np.random.default_rng(0).integers(2, 128, 80)]


@pytest.fixture(scope="module")
def llama(hf_folder):
    return minimlx.load(hf_folder("llama"), "float32")


def test_within_the_bound_it_is_the_plain_cache(llama):
    model, _ = llama
    ids = mx.array([IDS[:40]])
    bounded = model(ids, [SinkKVCache(64) for _ in model.layers])
    assert mx.array_equal(bounded, model(ids, [KVCache() for _ in model.layers])).item()
    settings = SamplingSettings(max_tokens=20)
    plain = list(generate_tokens(model, IDS[:40], make_cache(model), settings))
    assert list(generate_tokens(model, IDS[:40], make_cache(model, max_kv_size=64), settings)) == plain


def test_past_the_bound_each_token_reads_what_mlx_lms_rotating_cache_with_4_kept_reads(llama, hf_folder):
    """Token by token as mlx-lm decodes; a prefill longer than the window (one pass) reads the same per token."""
    require("mlx_lm")
    from mlx_lm.models.cache import RotatingKVCache
    from mlx_lm.utils import load_model

    model, _ = llama
    reference, _ = load_model(hf_folder("llama"))
    reference.set_dtype(mx.float32)
    theirs = [RotatingKVCache(max_size=16, keep=4) for _ in reference.layers]
    ours = make_cache(model, max_kv_size=16)
    expected, stepped = [], []
    for token in IDS:
        expected.append(reference(mx.array([[token]]), cache=theirs)[0, -1])
        stepped.append(model(mx.array([[token]]), ours)[0, -1])
    expected, stepped = np.array(mx.stack(expected)), np.array(mx.stack(stepped))
    assert relative_error(stepped, expected) < 1e-4
    whole = model(mx.array([IDS]), make_cache(model, max_kv_size=16))[0]
    assert relative_error(np.array(whole), expected) < 1e-4
    unbounded = np.array(model(mx.array([IDS]))[0])
    assert relative_error(unbounded[16:], expected[16:]) > 1e-2  # the bound changed what the late tokens read


def test_the_cache_stays_at_its_bound_over_a_long_generation(llama):
    model, _ = llama
    cache = make_cache(model, max_kv_size=32)
    tokens = generate_tokens(model, IDS[:8], cache, SamplingSettings(max_tokens=200))
    sizes = [sum(c.nbytes for c in cache) for i, _ in enumerate(tokens) if i in (60, 199)]
    kv_heads, head_dim = 2, 16  # tests/mlx_lm_reference.py's llama
    bound = len(model.layers) * 2 * kv_heads * 31 * head_dim * 4  # keys and values of 31 tokens, in float32
    assert sizes == [bound, bound] and [c.offset for c in cache] == [8 + 199] * len(model.layers)


def test_what_a_bounded_cache_cannot_do_is_refused_in_one_line(llama, hf_folder):
    model, _ = llama
    with pytest.raises(InvalidSettingError, match="drop kv_bits"):
        make_cache(model, kv_bits=8, max_kv_size=32)
    with pytest.raises(InvalidSettingError, match="not latent attention's"):
        make_cache(minimlx.load(hf_folder("deepseek_v3"), "float32")[0], max_kv_size=32)
    serve = ["serve", "--model", str(hf_folder("llama")), "--max-kv-size", "32", "--port", "0"]
    one_line_error(CliRunner().invoke(main, serve), "--max-batch 1")


def test_speculation_past_the_bound_takes_rejected_drafts_back(llama):
    """A bounded cache cannot trim back past what its window dropped: a speculative round restores the snapshot taken
    before its pass and feeds the kept tokens (`Rollback`), so greedy tokens stay plain decoding's."""
    model, _ = llama

    def decode(prompt: list[int], **options) -> tuple[list[int], Generation]:
        engine = Engine(model, max_batch=1, max_kv_size=16, **options)
        generation = engine.submit(Request(prompt, SamplingSettings(max_tokens=24), stop_ids=frozenset()))
        tokens = []
        while engine.busy:
            tokens += [output.token for output in engine.step()]
        return tokens, generation

    # the model drafts for itself, over a cache that keeps every token: where what the bound dropped matters, the
    # model rejects the draft
    plain, _ = decode(IDS[:40])
    speculative, generation = decode(IDS[:40], draft_model=model, draft_tokens=3)
    assert generation.drafted > generation.accepted > 0
    assert speculative == plain
