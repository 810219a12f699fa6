"""Hypothesis over the readers of untrusted input: GGUF and safetensors headers, config.json normalisation, chat
messages through a chat template. Random bytes and mutations of valid inputs either succeed or raise one
MinimlxError subclass, within a time bound; never another exception. Seeded and small here (CI); raise
`max_examples` with HYPOTHESIS_PROFILE=long for a longer run."""

import os
import struct
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import smollm2_path

from minimlx.archs.registry import plugin_config
from minimlx.errors import MinimlxError
from minimlx.io.checkpoint import read_safetensors
from minimlx.io.gguf_file import read_gguf

settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", derandomize=False, max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
SECONDS = 2.0  # the most one input may take to be read or refused


def bounded(read, *args):
    """`read(*args)`'s result or its MinimlxError, checked to come within SECONDS."""
    started = time.monotonic()
    try:
        return read(*args)
    except MinimlxError as e:
        return e
    finally:
        assert time.monotonic() - started < SECONDS


def valid_file(save) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "file"
        save(str(path))
        return (
            path.with_suffix(path.suffix).read_bytes() if path.exists() else next(Path(folder).iterdir()).read_bytes()
        )


TENSORS = {"token_embd.weight": mx.arange(64, dtype=mx.float32).reshape(8, 8), "norm": mx.ones(8, dtype=mx.float16)}
GGUF = valid_file(lambda p: mx.save_gguf(p + ".gguf", TENSORS, {"general.architecture": "llama", "vocab": ["a", "b"]}))
SAFETENSORS = valid_file(lambda p: mx.save_safetensors(p + ".safetensors", TENSORS, {"format": "mlx"}))


def mutations(valid: bytes):
    """`valid` with some bytes replaced, cut short, or with a little-endian integer (a count, a length) set."""
    edits = st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)), max_size=8)
    counts = st.lists(st.tuples(st.integers(0, len(valid) - 8), st.sampled_from([0, 1, 255, 2**31, 2**63, 2**64 - 1])))

    def apply(edits, counts, cut):
        data = bytearray(valid)
        for at, byte in edits:
            data[at] = byte
        for at, value in counts[:3]:
            data[at : at + 8] = struct.pack("<Q", value)
        return bytes(data[:cut])

    return st.builds(apply, edits, counts, st.integers(0, len(valid)))


def written(data: bytes, name: str):
    folder = tempfile.mkdtemp()
    (Path(folder) / name).write_bytes(data)
    return Path(folder)


@given(
    st.one_of(
        st.binary(max_size=512), st.binary(max_size=64).map(lambda b: b"GGUF\x03\x00\x00\x00" + b), mutations(GGUF)
    )
)
def test_gguf_reader_reads_or_refuses_any_bytes(data):
    folder = written(data, "model.gguf")
    result = bounded(read_gguf, folder / "model.gguf")
    assert isinstance(result, (tuple, MinimlxError))


@given(st.one_of(st.binary(max_size=512), mutations(SAFETENSORS)))
def test_safetensors_reader_reads_or_refuses_any_bytes(data):
    result = bounded(read_safetensors, written(data, "model.safetensors"))
    assert isinstance(result, (dict, MinimlxError))


LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "torch_dtype": "bfloat16",
}
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(
    st.one_of(
        JSON,
        st.dictionaries(st.sampled_from(sorted(LLAMA)), JSON, max_size=6).map(lambda d: {**LLAMA, **d}),
        st.sampled_from(sorted(LLAMA)).flatmap(
            lambda key: JSON.map(lambda value: {**LLAMA, key: value} | {"model_type": LLAMA["model_type"]})
        ),
    )
)
def test_config_normalisation_reads_or_refuses_any_json(config):
    result = bounded(plugin_config, config)
    assert not isinstance(result, BaseException) or isinstance(result, MinimlxError)


@pytest.fixture(scope="module")
def tokenizer():
    from minimlx.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(mx.load(str(smollm2_path()), return_metadata=True)[1])


TEXT = st.text(max_size=16) | st.sampled_from(["{{", "{% raw %}", "<|im_end|>", "\x00", "\ud7ff" * 4])
HOSTILE_MESSAGE = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | TEXT, "content": TEXT | JSON},
        optional={
            "tool_calls": JSON | st.lists(st.fixed_dictionaries({"id": JSON, "function": JSON})),
            "tool_call_id": JSON,
            "reasoning_content": JSON,
            "name": JSON,
        },
    ),
)


@pytest.mark.slow
@given(st.lists(HOSTILE_MESSAGE, max_size=5), st.none() | st.lists(JSON, max_size=2), st.booleans())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_chat_rendering_renders_or_refuses_hostile_messages(tokenizer, messages, tools, generation_prompt):
    result = bounded(tokenizer.apply_chat_template, messages, generation_prompt, tools)
    assert isinstance(result, (str, MinimlxError))
