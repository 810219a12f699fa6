"""Prompt caches that outlive the process: a prefix's cache saved to a file and read back continues as a cold run
does (plain, sliding-window, 8-bit and latent caches), a file of another model or a damaged one is refused in one
line, and a server started again with the same --prompt-cache-dir reuses the prefixes the last one cached."""

import logging

import mlx.core as mx
import pytest
from click.testing import CliRunner
from command_line import one_line_error
from models import chat_model
from servers import Served

import minimlx
from minimlx.cli import main
from minimlx.core.cache import quantized_cache
from minimlx.decode import SamplingSettings, generate_tokens, make_cache, stream_generate
from minimlx.decode.prefill import prefill
from minimlx.decode.prompt_cache import PromptCache, PromptFolder
from minimlx.errors import PromptCacheError

PREFIX = list(range(3, 40))  # longer than the sliding window of 4, which rolls over
PROMPT = PREFIX + [50, 51, 52]
MODELS = {
    "llama": ("LlamaConfig", dict(head_dim=32)),  # heads of 32 features, so that an 8-bit cache groups them
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=4)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, hf_folder):
    """name -> a tiny random model's folder (with a tokenizer and a chat template), built once."""
    built = {}

    def get(name):
        if name == "deepseek_v3":  # latent attention
            return hf_folder(name)
        if name not in built:
            built[name] = chat_model(tmp_path_factory.mktemp(name), 256, MODELS[name][0], **MODELS[name][1])
        return built[name]

    return get


@pytest.fixture(scope="module")
def models(folders):
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = minimlx.load(folders(name), "float32")
        return loaded[name]

    return get


def saved_file(path, model, tokenizer, kv_bits=None):
    """Save PREFIX's cache, prefilled here as the engine would, to `path`; the cache that was saved."""
    cache = [quantized_cache(c, kv_bits) for c in model.make_cache()]
    prefill(model, PREFIX, cache, 16)
    minimlx.save_prompt_cache(path, model, tokenizer, PREFIX, cache)
    return cache


def greedy(model, tokenizer, prompt, **options) -> tuple[list[int], int]:
    """(greedy ids, prompt tokens the saved prompt cache supplied) of stream_generate."""
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=8, **options))
    return [r.token for r in responses], responses[-1].cached_tokens


def cold(model, prompt, kv_bits=None) -> list[int]:
    return list(generate_tokens(model, prompt, make_cache(model, kv_bits), SamplingSettings(max_tokens=8)))


@pytest.mark.parametrize("name, kv_bits", [("llama", None), ("llama", 8), ("gemma2", None), ("deepseek_v3", None)])
def test_a_saved_prompt_continues_as_a_cold_run(models, tmp_path, name, kv_bits):
    model, tokenizer = models(name)
    path = tmp_path / "prefix.safetensors"
    cache = saved_file(path, model, tokenizer, kv_bits)
    saved = minimlx.load_prompt_cache(path, model, tokenizer)
    assert saved.ids == PREFIX and saved.kv_bits == kv_bits
    assert [type(c) for c in saved.cache] == [type(c) for c in cache]
    rest = mx.array([PROMPT[len(PREFIX) :]])
    loaded = model(rest, saved.holding(len(PREFIX), model.make_cache()))
    assert mx.array_equal(loaded, model(rest, cache)).item()  # the file holds the cache exactly
    whole = model(mx.array([PROMPT]), [quantized_cache(c, kv_bits) for c in model.make_cache()])
    assert mx.abs(loaded[0, -1] - whole[0, -1]).max().item() < 1e-4
    ids, cached = greedy(model, tokenizer, PROMPT, prompt_cache=saved)
    assert (ids, cached) == (cold(model, PROMPT, kv_bits)[: len(ids)], len(PREFIX))


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_prompt_that_leaves_the_saved_one_reuses_the_start_they_share(models, tmp_path, name):
    """Where a sliding window has dropped the tokens the shared start needs, nothing is reused."""
    model, tokenizer = models(name)
    saved_file(tmp_path / "prefix.safetensors", model, tokenizer)
    saved = minimlx.load_prompt_cache(tmp_path / "prefix.safetensors", model, tokenizer)
    for prompt, reused in ((PREFIX[:20] + [60, 61], 20), (PREFIX, len(PREFIX) - 1)):
        ids, cached = greedy(model, tokenizer, prompt, prompt_cache=saved)
        assert (ids, cached) == (cold(model, prompt)[: len(ids)], reused if name == "llama" else 0)


def test_a_file_another_model_made_or_a_damaged_one_is_refused_in_one_line(models, folders, tmp_path):
    llama, tokenizer = models("llama")
    saved_file(tmp_path / "llama.safetensors", llama, tokenizer, kv_bits=8)
    saved_file(tmp_path / "gemma2.safetensors", *models("gemma2"))
    whole = (tmp_path / "llama.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    half_precision = minimlx.load(folders("llama"), "float16")[0]
    cases = [
        ("gemma2.safetensors", llama, None, "was made by a Gemma2 model, not this Llama3 one"),
        (
            "llama.safetensors",
            half_precision,
            None,
            "or this one at another --dtype",
        ),
        ("llama.safetensors", llama, 4, "holds 8-bit keys and values, not 4-bit ones; pass --kv-bits 8"),
        ("cut.safetensors", llama, None, "cannot read"),
        ("absent.safetensors", llama, None, "cannot read"),
    ]
    for name, model, kv_bits, fragment in cases:
        with pytest.raises(PromptCacheError) as refused:
            minimlx.load_prompt_cache(tmp_path / name, model, tokenizer, kv_bits)
        assert fragment in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(PromptCacheError, match="is not a minimlx prompt cache file"):
        minimlx.load_prompt_cache(next(folders("llama").glob("*.safetensors")), llama, tokenizer)
    result = CliRunner().invoke(
        main,
        ["run", "w3", "--model", str(folders("llama")), "--prompt-cache-file", str(tmp_path / "gemma2.safetensors")],
    )
    one_line_error(result, "was made by a Gemma2 model")


def test_cache_prompt_then_run_from_the_file(folders, tmp_path):
    folder, out = str(folders("llama")), str(tmp_path / "prefix.safetensors")
    text = " ".join(f"w{i % 7 + 3}" for i in range(57))  # a token each
    runner = CliRunner()
    made = runner.invoke(main, ["cache-prompt", out, "--model", folder, "--prompt", text, "--dtype", "float32"])
    assert made.exit_code == 0, made.output
    assert made.stdout.startswith(f"wrote {out}: 58 tokens, ")  # "user" and the 57 words
    question = ["run", f"{text} w2 w3", "--model", folder, "--max-tokens", "6", "--dtype", "float32"]
    warm = runner.invoke(main, [*question, "--prompt-cache-file", out, "--stats"])
    assert warm.exit_code == 0, warm.output
    assert "tokens (58 from the prompt cache)" in warm.stderr
    assert warm.stdout == runner.invoke(main, question).stdout


def entry(model, ids: list[int]) -> list:
    """The cache of `ids`, its buffers holding those tokens only (so that its bytes count them alone)."""
    cache = model.make_cache()
    prefill(model, ids, cache, 16)
    return [c.prefix(len(ids)) for c in cache]


def test_the_folder_holds_the_entries_least_recently_used_out_first(models, tmp_path, caplog):
    model, tokenizer = models("llama")
    folder = PromptFolder(tmp_path, model, tokenizer)
    cache = PromptCache(2, folder=folder)
    first, second, third = [3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]
    for ids in (first, second):
        cache.store(ids, entry(model, ids))
    assert cache.fetch(first + [20])[0] == 4  # `first` is now the most recently used
    cache.store(third, entry(model, third))
    cache.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(folder.file(ids).name for ids in (first, third))
    (tmp_path / f"{folder.prefix}-damaged.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "another-model.safetensors").write_bytes(b"someone else's")
    with caplog.at_level(logging.WARNING, "minimlx.prompt_cache"):
        again = PromptCache(2, folder=PromptFolder(tmp_path, model, tokenizer))
    assert [ids for ids, _ in again.entries] == [first, third]
    assert len(caplog.records) == 2 and not (tmp_path / f"{folder.prefix}-damaged.safetensors").exists()
    assert (tmp_path / "another-model.safetensors").exists()  # another server's, left alone
    one = sum(c.nbytes for c in again.entries[-1][1])
    bounded = PromptCache(8, max_bytes=one, folder=PromptFolder(tmp_path, model, tokenizer))
    assert [ids for ids, _ in bounded.entries] == [third]  # within the bytes, the most recently used
    bounded.store(second, entry(model, second))
    bounded.flush()
    assert [ids for ids, _ in bounded.entries] == [second]
    assert {p.name for p in tmp_path.iterdir()} == {folder.file(second).name, "another-model.safetensors"}


@pytest.mark.slow
def test_a_restarted_server_reuses_the_prompt_cache_it_saved(folders, tmp_path):
    folder, kept = str(folders("llama")), str(tmp_path / "prompts")
    prompt = " ".join(f"w{i % 7 + 3}" for i in range(150))  # a token each
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    answers = []
    for _ in range(2):
        server = Served("--model", folder, "--prompt-cache-dir", kept, "--dtype", "float32")
        try:
            status, reply = server.post("/v1/completions", body)
            assert status == 200, reply
            answers.append((reply["choices"][0]["text"], reply["usage"]))
        finally:
            server.stop()
        assert server.process.wait(timeout=30) == 0
    (first, cold), (second, warm) = answers
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert (warm["prompt_tokens"], warm["prompt_tokens_details"]["cached_tokens"]) == (150, 149)  # all but the last
    assert second == first
