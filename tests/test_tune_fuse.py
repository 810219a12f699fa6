"""`minimlx fuse`: an adapter folded into its base, written as an MLX folder, a Hugging Face folder and a GGUF file,
gives the greedy tokens of the base with the adapter applied (`load(adapter=)`, the LoRA/DoRA forms), for llama,
qwen3, gemma3 and gpt-oss (whose MXFP4 experts stay packed in the MLX folder and are written fused and interleaved,
as transformers stores them, in the Hugging Face one). The GGUF files are llama.cpp's converter's (f32), read by
minimlx; transformers reads the Hugging Face folder. A base packed in 8 bits is fused into an 8-bit MLX folder."""

import json

import mlx.core as mx
import pytest
from adapter_files import FAMILIES
from models import Ids
from reference import require

import minimlx
from minimlx.decode import Engine, Request, SamplingSettings

PROMPT = [5, 17, 230, 41, 9]


def greedy(model, count=10, prompt=PROMPT) -> list[int]:
    """The model's greedy tokens after `prompt` (no end-of-sequence: the SentencePiece folders have no
    tokenizer.json)."""
    engine = Engine(model, Ids(), max_batch=1)
    generation = engine.submit(Request(prompt, SamplingSettings(max_tokens=count, temperature=0)))
    engine.run()
    return generation.tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_each_fused_output_gives_the_adapted_models_tokens(fused_families, name):
    base, adapter = fused_families / name, fused_families / f"{name}-adapter"
    adapted = greedy(adapted_model(base, "float32", adapter))
    assert adapted != greedy(minimlx.load_model(base, "float32"))  # the adapter changes the answer
    for output in (f"{name}-mlx", f"{name}-hf", f"{name}.gguf"):
        assert greedy(minimlx.load_model(fused_families / output, "float32")) == adapted, output
    config = json.loads((fused_families / f"{name}-hf" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization" not in config
    if name == "gpt_oss":  # packed experts stay packed in the MLX folder; the Hugging Face folder holds floats
        mlx_config = json.loads((fused_families / f"{name}-mlx" / "config.json").read_text())
        assert mlx_config["quantization"]["mode"] == "mxfp4"
    if name == "llama":  # transformers reads the Hugging Face folder as minimlx does
        torch, transformers = require("torch"), require("transformers")
        model = transformers.AutoModelForCausalLM.from_pretrained(fused_families / f"{name}-hf", dtype=torch.float32)
        tokens = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)[0, len(PROMPT) :]
        assert tokens.tolist() == adapted[: len(tokens)]


@pytest.mark.slow
def test_a_packed_base_fuses_into_a_packed_mlx_folder(fused_families, tmp_path):
    """An 8-bit MLX base: the fused folder keeps every map packed in 8 bits (the adapted ones packed again), and
    gives the adapted packed model's tokens."""
    from minimlx.tune.fuse import fuse

    packed = minimlx.convert(fused_families / "llama", tmp_path / "llama-8bit", bits=8, group_size=32)
    adapter = fused_families / "llama-adapter"
    out = fuse(packed, adapter, tmp_path / "fused-8bit")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    weights = mx.load(str(out / "model.safetensors"))
    assert (
        "model.layers.0.self_attn.q_proj.scales" in weights
        and weights["model.layers.0.self_attn.q_proj.weight"].dtype.size == 4
    )
    assert greedy(minimlx.load_model(out, "quantized")) == greedy(adapted_model(packed, "quantized", adapter))


def adapted_model(base, dtype: str, adapter):
    from minimlx.tune import load_adapter

    model = minimlx.load_model(base, dtype)
    load_adapter(model, adapter)
    return model.eval() or model


@pytest.mark.parametrize(
    "args, message",
    [
        (["--save-path", "out.gguf"], "GGUF files are written by llama.cpp's own converter; pass --llama-cpp DIR"),
        (["--save-path", "out", "--export-gguf", "--de-quantize"], "ask for gguf and hf; give one"),
        (["--save-path", "out", "--dtype", "float8"], "unknown dtype 'float8'"),
    ],
)
def test_fuse_refuses_what_it_cannot_write_before_anything_loads(args, message, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main

    monkeypatch.delenv("MINIMLX_LLAMACPP", raising=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["fuse", "--model", "no-such-model", "--adapter-path", "adapter", *args])
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1


def test_an_expert_adapter_fuses(tmp_path):
    """An adapter of a mixture's stacked experts (and queries), fused into an MLX and a Hugging Face folder, gives the
    adapted model's greedy tokens from each; on a base packed in 8 bits the experts are packed again in 8 bits."""
    from tuning import MOE, tiny_llama

    from minimlx.tune import AdapterSettings, attach, save_adapter
    from minimlx.tune.fuse import fuse
    from minimlx.tune.lora import expert_adapters

    base = tiny_llama(tmp_path / "moe", **MOE)
    model = minimlx.load_model(base, "float32")
    attach(model, AdapterSettings(rank=4, alpha=8, targets=("q_proj",), experts=("gate_up_proj", "down_proj")))
    mx.random.seed(3)
    for form in expert_adapters(model).values():
        for low_rank in (form.gate_up_proj, form.down_proj):
            low_rank.lora_b = mx.random.normal(low_rank.lora_b.shape) * 0.5
    adapter = save_adapter(model.eval(), tmp_path / "adapter")
    prompt = [5, 17, 23, 41, 9]
    adapted = greedy(adapted_model(base, "float32", adapter), prompt=prompt)
    assert adapted != greedy(minimlx.load_model(base, "float32"), prompt=prompt)
    for format in ("mlx", "hf"):
        out = fuse(base, adapter, tmp_path / f"fused-{format}", format=format)
        assert greedy(minimlx.load_model(out, "float32"), prompt=prompt) == adapted, format
    packed = minimlx.convert(base, tmp_path / "moe-8bit", bits=8, group_size=32)
    out = fuse(packed, adapter, tmp_path / "fused-8bit")
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.mlp.switch_mlp.gate_proj.scales"].ndim == 3
    expected = greedy(adapted_model(packed, "quantized", adapter), prompt=prompt)
    assert greedy(minimlx.load_model(out, "quantized"), prompt=prompt) == expected
