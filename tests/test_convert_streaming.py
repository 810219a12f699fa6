"""`minimlx convert` writes each tensor as it is computed: its safetensors writer, and converting a GGUF file.

The writer's files hold what `mx.save_safetensors` writes for the same arrays, and MLX's reader (mlx-lm's) and the
safetensors package read them. A GGUF conversion holds about one tensor at a time: its peak resident memory over
the runtime's (the same command on a narrow model with the same vocabulary) is under twice the largest tensor, on a
model of three times that; and the tensors it computes a few at a time from the file tensors they
read are the ones the whole model read at once gives, for each way a plugin converts GGUF tensors.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from kquant_llama import MERGES, byte_tokens
from reference import require

from minimlx.cli import main
from minimlx.convert import output_tensors, safetensors_header, sources, write_tensor
from minimlx.loading import read_checkpoint

convert_module = sys.modules["minimlx.convert"]  # (`minimlx.convert` is the function)


def streamed(path: Path, arrays: dict[str, mx.array]) -> None:
    """`arrays` written as `minimlx convert` writes a shard: the header, then each tensor."""
    with open(path, "wb") as file:
        file.write(safetensors_header({name: (w.shape, w.dtype) for name, w in arrays.items()}))
        for w in arrays.values():
            write_tensor(file, w)


def header(path: Path) -> tuple[int, dict, bytes]:
    """A safetensors file's header length, header and data section."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length]), data[8 + length :]


ARRAYS = {
    "model.embed_tokens.weight": mx.arange(24, dtype=mx.float32).reshape(4, 6).T,  # not row-major in memory
    "model.layers.0.mlp.down_proj.weight": mx.array(np.arange(40, dtype=np.uint32).reshape(5, 8)),
    "model.layers.0.mlp.down_proj.scales": mx.linspace(-1, 1, 10).astype(mx.bfloat16).reshape(5, 2),
    "model.norm.weight": mx.ones((6,), mx.float16) / 3,
    "lm_head.bias": mx.array([1, -2, 3], mx.int8),
    "empty": mx.zeros((0, 4), mx.float32),
    "scalar": mx.array(7, mx.int64),
}


def test_the_writer_writes_what_mx_save_safetensors_does(tmp_path):
    """The same header entries (dtype, shape, metadata) and, at each tensor's offsets, the same bytes; the header is
    padded to 8 bytes (as the format advises; MLX's is not), and the tensors follow in the order given."""
    streamed(tmp_path / "ours.safetensors", ARRAYS)
    mx.save_safetensors(str(tmp_path / "mlx.safetensors"), ARRAYS, metadata={"format": "mlx"})
    length, ours, our_data = header(tmp_path / "ours.safetensors")
    _, theirs, their_data = header(tmp_path / "mlx.safetensors")
    assert (8 + length) % 8 == 0
    assert ours.pop("__metadata__") == theirs.pop("__metadata__") == {"format": "mlx"}
    assert list(ours) == sorted(ARRAYS) and set(theirs) == set(ARRAYS)
    assert len(our_data) == len(their_data) == sum(w.nbytes for w in ARRAYS.values())
    start = 0
    for name, w in ARRAYS.items():
        (a, b), (c, d) = ours[name].pop("data_offsets"), theirs[name].pop("data_offsets")
        assert (a, b) == (start, start + w.nbytes) and ours[name] == theirs[name], name
        assert our_data[a:b] == their_data[c:d], name
        start = b


def test_mlx_and_the_safetensors_package_read_the_writers_files(tmp_path):
    torch, safetensors = require("torch"), require("safetensors.torch")
    streamed(tmp_path / "model.safetensors", ARRAYS)
    loaded, metadata = mx.load(str(tmp_path / "model.safetensors"), return_metadata=True)
    assert metadata == {"format": "mlx"} and loaded.keys() == ARRAYS.keys()
    for name, w in ARRAYS.items():
        assert loaded[name].dtype == w.dtype and mx.array_equal(loaded[name], w), name
    for name, t in safetensors.load_file(str(tmp_path / "model.safetensors")).items():
        assert t.shape == ARRAYS[name].shape and str(t.dtype).endswith(str(ARRAYS[name].dtype).split(".")[-1]), name
        assert np.array_equal(t.to(torch.float64).numpy(), np.array(ARRAYS[name].astype(mx.float32))), name


def test_the_sources_of_lazy_arrays_are_read_off_their_graphs():
    """More arrays than one drawing of the graph names (1024): sums of two inputs, a cast of one, an input itself,
    and one output twice."""
    inputs = {f"w{i}": mx.zeros((2,)) for i in range(1500)}
    outputs = {f"sum{i}": inputs[f"w{i}"] + inputs[f"w{1499 - i}"] for i in range(700)}
    outputs |= {"cast": inputs["w3"].astype(mx.float16), "as is": inputs["w1000"], "again": outputs["sum5"]}
    reads = sources(outputs, inputs)
    assert all(reads[f"sum{i}"] == {f"w{i}", f"w{1499 - i}"} for i in range(700))
    assert (reads["cast"], reads["as is"], reads["again"]) == ({"w3"}, {"w1000"}, {"w5", "w1494"})


def write_llama(path: Path, hidden: int, ffn: int, seed: int = 0) -> int:
    """A one-block random llama as an F32 GGUF, written tensor by tensor, with the byte-level vocabulary of
    kquant_llama.py; returns the bytes of its largest tensor."""
    gguf = require("gguf")
    rng, heads = np.random.default_rng(seed), 8
    tokens = [*byte_tokens(), *(merge.replace(" ", "") for merge in MERGES), "<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_context_length, 256),
        (writer.add_embedding_length, hidden),
        (writer.add_block_count, 1),
        (writer.add_feed_forward_length, ffn),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, heads // 2),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_dimension_count, hidden // heads),
        (writer.add_vocab_size, len(tokens)),
        (writer.add_tokenizer_model, "gpt2"),
        (writer.add_tokenizer_pre, "gpt-2"),
        (writer.add_token_list, tokens),
        (writer.add_token_merges, MERGES),
        (writer.add_eos_token_id, len(tokens) - 1),
    ]:
        add(value)
    shapes = {
        "token_embd.weight": (len(tokens), hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
        "output_norm.weight": (hidden,),
        "output.weight": (len(tokens), hidden),
    }
    for name, shape in shapes.items():
        writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape in shapes.values():
        writer.write_tensor_data(rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(shape[-1])))
    writer.close()
    return max(int(np.prod(shape)) * 4 for shape in shapes.values())


# Run in a small process of its own: a child's peak resident set starts from its parent's at the fork (Linux keeps
# it through exec), which under pytest is larger than the conversion's.
PEAK_RSS = """
import os, subprocess, sys
process = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(process.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024))
"""


def peak_rss(command: list[str]) -> int:
    """The peak resident set of `command` run to completion in a fresh process, in bytes."""
    run = subprocess.run([sys.executable, "-c", PEAK_RSS, *command], capture_output=True, text=True, timeout=300)
    status, peak = run.stdout.split()
    assert status == "0", run.stderr[-3000:]
    return int(peak)


@pytest.mark.slow
def test_converting_a_gguf_holds_about_one_tensor_at_a_time(tmp_path):
    """Three 42 MB FFN matrices of 140 MB of tensors: converting them all at once would hold 3.3 times the largest
    over the runtime (the whole model), this holds 1.1 times it (measured)."""
    largest = write_llama(tmp_path / "big.gguf", hidden=1024, ffn=10240)
    write_llama(tmp_path / "tiny.gguf", hidden=64, ffn=128)
    total = (tmp_path / "big.gguf").stat().st_size
    assert largest > 40e6 and total > 3 * largest

    def convert(name: str) -> int:
        out = tmp_path / f"{name}-mlx"
        return peak_rss([sys.executable, "-W", "ignore", "-m", "minimlx", "convert", str(tmp_path / name), str(out)])

    peak, runtime = convert("big.gguf"), convert("tiny.gguf")
    print(f"peak {peak / 1e6:.0f} MB, runtime {runtime / 1e6:.0f} MB, largest tensor {largest / 1e6:.0f} MB")
    assert peak - runtime < 2 * largest
    written = mx.load(str(tmp_path / "big.gguf-mlx" / "model.safetensors"))
    assert sum(w.nbytes for w in written.values()) > 3 * largest


# The fixtures whose GGUF tensors each plugin converts its own way: q/k rows permuted back (and biases), q/k/v split
# and fused back, a shared expert's gate reshaped, kv_b split per head, norms less one, q/k/v and gate/up split,
# MXFP4 experts.
FAMILIES = ["llama", "gpt2", "qwen2_moe", "deepseek_v2_lite", "gemma3", "phi3", "gpt_oss"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_gguf_tensors_are_the_whole_models(converted, name, tmp_path, monkeypatch):
    """q8_0 files converted as stored, and the llama file also quantized and cast, each tensor in a group of its
    own (computed from just the file tensors its graph reads): each tensor written equals the one the conversion
    computes from every file tensor read at once."""
    monkeypatch.setattr(convert_module, "grouped", lambda tensors, reads, _: [([n], reads[n]) for n in tensors])
    path = converted / f"{name}-q8_0.gguf"
    variants = {"stored": []}
    if name == "llama":
        variants |= {"4bit": ["-q", "--bits", "4"], "bfloat16": ["--dtype", "bfloat16"]}
    for variant, flags in variants.items():
        result = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / variant), *flags])
        assert result.exit_code == 0, result.output
        quantize, dtype = "-q" in flags, "bfloat16" if "--dtype" in flags else None
        settings = dict(quantize=quantize, bits=4 if quantize else None, group_size=32 if quantize else None)
        whole = read_checkpoint(path, dtype)  # every tensor read
        expected, _ = output_tensors(whole, **settings, mode="affine", recipe=None, dtype=dtype)
        written = mx.load(str(tmp_path / variant / "model.safetensors"))
        assert written.keys() == expected.keys()
        for tensor, w in expected.items():
            assert written[tensor].dtype == w.dtype and mx.array_equal(written[tensor], w), (variant, tensor)
