"""Adapter folders for the tests: PEFT's, written by PEFT itself on the transformers model of a tiny random checkpoint
(its LoRA or DoRA matrices seeded random: PEFT starts B at zero, which would change nothing), and minimlx's own
(`save_adapter`); and the fused outputs of four families' adapters with the GGUF files llama.cpp makes of them."""

import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llamacpp import convert, convert_adapter, llamacpp_lora_sources
from llamacpp_models import MODELS, SENTENCEPIECE, converter_inputs, save_model
from reference import require

FAMILIES = {  # family -> (adapter targets, DoRA)
    "llama": (("q_proj", "v_proj", "down_proj"), False),
    "qwen3": (("k_proj", "o_proj", "up_proj"), True),
    "gemma3": (("q_proj", "gate_proj"), False),
    "gpt_oss": (("q_proj", "k_proj", "v_proj", "o_proj"), False),
}


def peft_adapter(
    torch_model, folder: Path, seed: int, targets=("q_proj", "v_proj", "down_proj"), rank=4, alpha=8, dora=False
) -> Path:
    """A PEFT adapter of `torch_model` (left as it is) saved to `folder`: rank `rank`, lora_alpha `alpha` on the
    Hugging Face projections `targets`, its matrices random (seed `seed`)."""
    torch, peft = require("torch"), require("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_dora=dora)
    adapted = peft.get_peft_model(copy.deepcopy(torch_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                noise = torch.randn(p.shape, generator=generator) * 0.3
                p.copy_(p + noise if "magnitude" in name else noise)
    adapted.save_pretrained(folder)
    return folder


def minimlx_adapter(base: Path, folder: Path, seed: int) -> Path:
    """An adapter minimlx attaches to the model in `base` and saves in PEFT's format (its B random, as training
    leaves it)."""
    import mlx.core as mx

    import minimlx
    from minimlx.tune import AdapterSettings, adapters, attach, save_adapter

    model = minimlx.load_model(base, "float32")
    attach(model, AdapterSettings(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj")))
    mx.random.seed(seed)
    for form in adapters(model).values():
        form.lora_b = mx.random.normal(form.lora_b.shape) * 0.3
    return save_adapter(model.eval(), folder, base_model=str(base))


def fused_families(root: Path) -> Path:
    """For each family F of FAMILIES: its source folder root/F, a PEFT adapter root/F-adapter, and that adapter fused
    into root/F-mlx, root/F-hf and root/F.gguf (f32; llama's through fuse's own call of llama.cpp's converter, the
    others' converted from their Hugging Face folders). For llama also: the base as root/llama-f32.gguf, and an
    adapter minimlx saved, root/llama-minimlx-adapter, with llama.cpp's GGUF of it, root/llama-minimlx-adapter.gguf.
    The converters' processes start slowly: they run side by side."""
    require("peft")
    from minimlx.tune.fuse import fuse

    sources, tokenizer = converter_inputs(llamacpp_lora_sources)
    jobs = [(root / "llama", "f32", root / "llama-f32.gguf")]
    for name, (targets, dora) in FAMILIES.items():
        base = save_model(root, name, MODELS, SENTENCEPIECE, tokenizer)
        config_class = MODELS[name][0]
        adapter = peft_adapter(reference_model(base, config_class), root / f"{name}-adapter", 3, targets, dora=dora)
        fuse(base, adapter, root / f"{name}-mlx")
        fuse(base, adapter, root / f"{name}-hf", format="hf")
        if name != "llama":
            jobs.append((root / f"{name}-hf", "f32", root / f"{name}.gguf"))
    ours = minimlx_adapter(root / "llama", root / "llama-minimlx-adapter", seed=4)
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(convert, jobs, sources, 1)]
        done.append(pool.submit(convert_adapter, ours, root / "llama", "f32", root / "llama-minimlx-adapter.gguf"))
        fuse(root / "llama", root / "llama-adapter", root / "llama.gguf", gguf_type="f32", llama_cpp=sources)
        [d.result() for d in done]
    return root


def reference_model(folder: Path, config_class: str):
    """The transformers model of a source folder (gpt-oss's MXFP4 experts read from the dense copy beside it)."""
    torch, transformers = require("torch"), require("transformers")
    dense = folder.with_name(f"{folder.name}-dense")
    path = dense if config_class.startswith("mxfp4:") else folder
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
