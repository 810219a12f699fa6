"""`minimlx convert`: Hugging Face folders and a GGUF file into MLX folders that minimlx and mlx-lm both load.

Tiny random llama (llama3 RoPE scaling), qwen3, qwen3_moe and deepseek_v3 folders are converted 4-bit,
8-bit with groups of 32, with the mixed-3-6 recipe and to bfloat16; mlx-lm must load every output and give
minimlx's float32 logits. The quantized logits are also compared with the float model's, against bounds
measured on these models. SmolLM2's GGUF file is converted 4-bit and still answers "Paris"; a model in
five shards is converted in about the memory of its largest tensor; bad settings fail with one line.
"""

import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm_reference import CONFIGS, VOCAB, mlx_lm_logits
from models import smollm2_path
from reference import random_ids, relative_error, require

import minimlx
from minimlx.cli import main
from minimlx.io.gguf_file import read_gguf
from minimlx.text import Tokenizer

VARIANTS = {
    "4bit": ["-q"],
    "8bit-g32": ["--bits", "8", "--group-size", "32"],
    "mixed-3-6": ["--recipe", "mixed-3-6"],
    "bfloat16": ["--dtype", "bfloat16"],
}
# Relative error of the 4-bit (groups of 64) and 8-bit (groups of 32) models' float32 logits against the float
# model's, measured on these random models: 4-bit llama 0.565, qwen3 0.417, qwen3_moe 0.448, deepseek_v3 0.733;
# 8-bit 0.031, 0.022, 0.020, 0.034. The errors are large because the models are random and tiny, and the same
# as mlx_lm.convert's own 4-bit output (bit for bit for the dense models; its qwen3_moe router is 8-bit, here
# float). The bounds are the measures times 1.5; unrelated logits of the same size would be ~1.4 apart.
BOUNDS = {
    "4bit": {"llama": 0.85, "qwen3": 0.63, "qwen3_moe": 0.67, "deepseek_v3": 1.1},
    "8bit-g32": {"llama": 0.046, "qwen3": 0.033, "qwen3_moe": 0.03, "deepseek_v3": 0.052},
}
PROMPT = "What is the capital of France?"


def convert(*args):
    result = CliRunner().invoke(main, ["convert", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_folder):
    built = {}

    def get(name, variant):
        if (name, variant) not in built:
            out = tmp_path_factory.mktemp(f"mlx-{name}") / variant
            result = convert(hf_folder(name), out, *VARIANTS[variant])
            assert "model.safetensors" in result.stderr and f"wrote {out}" in result.stderr
            built[name, variant] = out
        return built[name, variant]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mlx_lm_loads_the_conversion(converted, hf_folder, name, variant):
    out = converted(name, variant)
    ids = random_ids(VOCAB)
    ours = np.array(minimlx.load_model(out, dtype="float32")(mx.array(ids)))
    theirs = np.array(mlx_lm_logits(out, ids))
    assert relative_error(ours, theirs) < 1e-4, relative_error(ours, theirs)
    if variant in BOUNDS:
        float_logits = np.array(minimlx.load_model(hf_folder(name), dtype="float32")(mx.array(ids)))
        error = relative_error(ours, float_logits)
        print(f"{name} {variant}: relative error {error:.4f} against the float model (bound {BOUNDS[variant][name]})")
        assert error < BOUNDS[variant][name]


@pytest.mark.slow
def test_what_the_folder_holds(converted):
    quantization = json.loads((converted("llama", "4bit") / "config.json").read_text())["quantization"]
    assert quantization == {"group_size": 64, "bits": 4, "mode": "affine"}
    config = json.loads((converted("qwen3_moe", "mixed-3-6") / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"]
    entry = config["quantization"]
    assert entry["bits"] == 3 and entry["model.layers.1.self_attn.v_proj"]["bits"] == 6  # mlx-lm's module names
    assert entry["model.layers.1.mlp.switch_mlp.down_proj"]["bits"] == 6 and entry["lm_head"]["bits"] == 6
    model = minimlx.load_model(converted("qwen3_moe", "mixed-3-6"), dtype="quantized")
    assert model.layers[1].attn.v_proj.bits == 6 and model.layers[1].attn.q_proj.bits == 3
    assert model.layers[1].ffn.router.proj.weight.dtype == mx.float32  # routers stay in float
    bf16 = converted("deepseek_v3", "bfloat16")
    assert "quantization" not in json.loads((bf16 / "config.json").read_text())
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    names = mx.load(str(bf16 / "model.safetensors"))
    assert {"model.layers.1.self_attn.embed_q.weight", "model.layers.1.mlp.switch_mlp.gate_proj.weight"} <= set(names)
    assert all(w.dtype == mx.bfloat16 for w in names.values())
    assert {p.name for p in bf16.iterdir()} >= {"config.json", "tokenizer.json", "tokenizer_config.json", "README.md"}


def test_cpu_default_runs_what_the_kernel_reads_packed_and_the_rest_in_float32(hf_folder, tmp_path):
    """With the native kernel installed, the CPU default (dtype None) keeps a mixed-4-6 folder's 4-bit maps packed on
    the kernel and dequantizes its 6-bit ones to float32 (MLX's packed CPU kernels are 10-100x slower); the logits
    are the float32 dequantized model's."""
    pytest.importorskip("minimlx_native", reason="the native kernel is not installed (pip install -v -e . says why)")
    from minimlx.cpu.linear import NativeQuantizedLinear

    out = tmp_path / "mixed-4-6"
    convert(hf_folder("llama"), out, "--recipe", "mixed-4-6")
    entry = json.loads((out / "config.json").read_text())["quantization"]
    assert entry["bits"] == 4 and entry["model.layers.1.self_attn.v_proj"]["bits"] == 6
    model = minimlx.load_model(out)
    attn = model.layers[1].attn
    assert isinstance(attn.q_proj, NativeQuantizedLinear) and attn.q_proj.bits == 4
    assert isinstance(attn.v_proj, nn.Linear) and attn.v_proj.weight.dtype == mx.float32
    ids = random_ids(VOCAB)
    float32 = np.array(minimlx.load_model(out, dtype="float32")(mx.array(ids)))
    assert relative_error(np.array(model(mx.array(ids))), float32) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_mlx_lm_loads_the_tokenizer_too(converted, name):
    mlx_lm = require("mlx_lm")
    out = converted(name, "4bit")
    model, tokenizer = mlx_lm.load(str(out))
    ours, our_tokenizer = minimlx.load(out)
    ids = our_tokenizer.encode("w3 w17 w99 w5")
    assert tokenizer.encode("w3 w17 w99 w5") == ids
    model.set_dtype(mx.float32)
    assert relative_error(np.array(ours(mx.array([ids]))), np.array(model(mx.array([ids])))) < 1e-4


@pytest.fixture(scope="module")
def smollm2_4bit(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-4bit"
    convert(smollm2_path(), out, "-q")
    return out


@pytest.mark.slow
def test_gguf_to_4bit_still_answers_paris(smollm2_4bit):
    entry = json.loads((smollm2_4bit / "config.json").read_text())["quantization"]
    assert entry == {"group_size": 32, "bits": 4, "mode": "affine"}  # re-quantized on the GGUF's own groups
    args = ["run", "--model", str(smollm2_4bit), PROMPT, "--temp", "0", "--max-tokens", "12"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


@pytest.mark.slow
def test_gguf_conversion_reads_in_transformers_and_mlx_lm(smollm2_4bit):
    transformers, mlx_lm = require("transformers"), require("mlx_lm")
    _, tokenizer = minimlx.load(smollm2_4bit)
    gguf_tokenizer = Tokenizer.from_gguf(read_gguf(smollm2_path())[1])
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_4bit))
    text = "Hello world, <|im_start|> 12345 héllo"
    assert theirs.encode(text) == tokenizer.encode(text) == gguf_tokenizer.encode(text)
    messages = [{"role": "user", "content": PROMPT}]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == tokenizer.apply_chat_template(messages) == gguf_tokenizer.apply_chat_template(messages)
    assert tokenizer.eos_token_ids == gguf_tokenizer.eos_token_ids
    model, _ = mlx_lm.load(str(smollm2_4bit))
    ids = mx.array([tokenizer.encode("The capital of France")])
    ours = minimlx.load_model(smollm2_4bit, dtype="quantized")
    model.set_dtype(mx.float32)
    assert relative_error(np.array(ours(ids)), np.array(model(ids))) < 1e-4


def peak_memory(code: str) -> int:
    """MLX's peak memory, in bytes, over `code` run in a fresh process (nothing else allocated before it)."""
    lines = ["import minimlx, mlx.core as mx", "mx.reset_peak_memory()", textwrap.dedent(code)]
    script = "\n".join([*lines, "print(mx.get_peak_memory())"])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


@pytest.mark.slow
def test_loading_the_4bit_folder_takes_about_its_size(smollm2_4bit):
    size = sum(p.stat().st_size for p in smollm2_4bit.glob("*.safetensors"))
    peak = peak_memory(f"minimlx.load({str(smollm2_4bit)!r}, dtype='quantized')")
    print(f"loading {size / 1e6:.1f} MB of 4-bit weights: peak {peak / 1e6:.1f} MB ({peak / size:.2f}x)")
    assert peak < 1.3 * size


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A random 4.5M-parameter llama saved by transformers in five shards of at most 4 MB."""
    torch, transformers = require("torch"), require("transformers")
    folder = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="4MB")
    assert len(list(folder.glob("*.safetensors"))) >= 4
    return folder


@pytest.mark.parametrize("options", [{"quantize": True}, {"shard_size": "largest"}], ids=["4bit", "float"])
def test_conversion_streams_tensor_by_tensor(sharded, tmp_path, options):
    """MLX's peak is about the largest tensor (1.05 MB), far under one shard (3.94 MB): measured 1.15x it with -q,
    1.00x as stored."""
    largest = max(p.stat().st_size for p in sharded.glob("*.safetensors"))
    tensor = max(w.nbytes for p in sharded.glob("*.safetensors") for w in mx.load(str(p)).values())
    options = {k: largest if v == "largest" else v for k, v in options.items()}
    out = tmp_path / "out"
    peak = peak_memory(f"""
        import warnings
        warnings.simplefilter("ignore")  # the folder has no tokenizer
        minimlx.convert({str(sharded)!r}, {str(out)!r}, **{options!r})
    """)
    print(f"{options}: peak {peak / 1e6:.2f} MB, largest shard {largest / 1e6:.2f} MB, tensor {tensor / 1e6:.2f} MB")
    assert peak < 1.5 * tensor < largest / 2
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    if "shard_size" in options:
        assert len(shards) >= 4 and (out / "model.safetensors.index.json").is_file()
    ids = mx.array(random_ids(1024, batch=1, tokens=8))
    model = minimlx.load_model(sharded, dtype="float32")
    if options.get("quantize"):
        minimlx.quantize(model)  # the same model quantized in memory
    written = minimlx.load_model(out, dtype="quantized" if options.get("quantize") else "float32")
    # 1e-5: packed products may run in the native kernel, whose float32 rounding differs from MLX's
    assert relative_error(np.array(written(ids)), np.array(model(ids))) < 1e-5


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "options, fragments",
    [
        (["-q", "--bits", "7"], ["affine quantization takes bits 2, 3, 4, 5, 6, 8, not 7"]),
        (["--recipe", "mixed-9-9"], ["unknown recipe 'mixed-9-9'", "mixed-3-6"]),
        (["--group-size", "48"], ["group size 48 is not supported"]),
        (["--dtype", "float8"], ["unknown dtype 'float8'"]),
    ],
)
def test_bad_settings_fail_before_anything_is_written(tmp_path, options, fragments):
    out = tmp_path / "out"
    one_line_error(CliRunner().invoke(main, ["convert", str(tmp_path / "anything"), str(out), *options]), *fragments)
    assert not out.exists()


def test_an_existing_folder_is_not_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "anything"), str(tmp_path / "out"), "-q"])
    one_line_error(result, "already exists and is not an empty folder")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def refused_after_progress(result, *fragments):
    """Exit status 2 and, after the line that says what the conversion does, one error line: no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 2 and lines[1].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and all(fragment in lines[1] for fragment in fragments)


def test_force_replaces_an_existing_folder(hf_folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    convert(hf_folder("llama"), out, "--force")
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it


def test_a_conversion_that_would_not_fit_the_disk_is_refused_before_it_starts(hf_folder, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**5, 10**5))
    result = CliRunner().invoke(main, ["convert", str(hf_folder("llama")), str(tmp_path / "out")])
    refused_after_progress(result, "not enough disk space", "GB are free")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_target_as_it_was(hf_folder, tmp_path, monkeypatch):
    """The disk fills up at the third tensor: one line, and no folder."""
    import errno
    import os

    written, write = [], sys.modules["minimlx.convert"].write_tensor

    def filling(file, w):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(write(file, w))

    monkeypatch.setattr(sys.modules["minimlx.convert"], "write_tensor", filling)
    result = CliRunner().invoke(main, ["convert", str(hf_folder("llama")), str(tmp_path / "out")])
    refused_after_progress(result, "writing", "No space left on device", "is as it was")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_conversion_killed_at_any_point_leaves_no_half_written_folder(sharded, tmp_path):
    """Killed (SIGKILL, no cleanup) at ten seeded random points from start to end: the folder is absent, or whole
    and loadable."""
    import random
    import time

    def start(out):
        code = f"import minimlx; minimlx.convert({str(sharded)!r}, {str(out)!r}, shard_size=2 << 20)"
        return subprocess.Popen([sys.executable, "-W", "ignore", "-c", code])

    began = time.perf_counter()
    assert start(tmp_path / "whole").wait(timeout=120) == 0
    duration = time.perf_counter() - began
    moments = random.Random(0)
    for trial in range(10):
        out = tmp_path / f"killed-{trial}"
        process = start(out)
        time.sleep(duration * moments.random())
        process.kill()
        process.wait(timeout=30)
        if out.exists():
            assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
            minimlx.load_model(out)


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MB tmpfs (mounting needs root, as CI has; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)], capture_output=True, text=True, timeout=30
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'mount failed'}")
    yield disk
    subprocess.run(["umount", str(disk)], timeout=30, check=True)


@pytest.fixture(scope="module")
def model_of_40_mb(tmp_path_factory):
    torch, transformers = require("torch"), require("transformers")
    folder = tmp_path_factory.mktemp("forty-mb")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    assert sum(p.stat().st_size for p in folder.glob("*.safetensors")) > 40e6
    return folder


def test_a_conversion_onto_a_20_mb_disk_is_refused_in_one_line_before_it_writes(model_of_40_mb, small_disk):
    out = small_disk / "out"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "minimlx", "convert", str(model_of_40_mb), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert lines[-1].startswith("error: not enough disk space") and "GB are free" in lines[-1], result.stderr
    assert list(small_disk.iterdir()) == []


def test_a_conversion_that_fills_a_20_mb_disk_leaves_no_folder(model_of_40_mb, small_disk, monkeypatch):
    """With the precheck out of the way the disk fills up mid-write: one line, and nothing left on the disk."""
    monkeypatch.setattr(sys.modules["minimlx.convert"], "check_room", lambda out, nbytes: None)
    result = CliRunner().invoke(main, ["convert", str(model_of_40_mb), str(small_disk / "out")])
    refused_after_progress(result, "writing")
    assert list(small_disk.iterdir()) == []
