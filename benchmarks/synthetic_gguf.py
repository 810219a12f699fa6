"""The benchmarks' standard synthetic GGUF files: a LLaMA-shaped 1B and 3B, a Qwen3-shaped 4B and a Qwen3.5-shaped 0.8B
of random weights, as Hugging Face folders (float16 safetensors, a shard per layer, SmolLM2's tokenizer), converted to
F16 by llama.cpp's own converter and quantized by its `llama-quantize` to Q4_K_M, Q5_K_M, Q6_K and Q8_0, as a user's
downloads are.

    python benchmarks/synthetic_gguf.py [--folder DIR] [--models llama-1b,llama-3b,qwen3-4b,qwen35-0.8b] [--types ...]

Files already in the folder are kept (the F16 file of a 4B is 8 GB; each takes minutes on 2 cores). The shapes are
TinyLlama-1.1B's, Llama-3.2-3B's, Qwen3-4B's and Qwen3.5-0.8B's with SmolLM2's 49,152-token vocabulary (the converter
must know the tokenizer; the weights' bytes per token differ from the originals' only in the embedding and head).

Qwen3.5-0.8B's are the text model's of its published config.json (`text_config` of Qwen/Qwen3.5-0.8B, as quoted in
several public repositories: hidden 1024, FFN 3584, 24 layers of which every 4th attends with 8 query heads and 2
key-value heads of 256 (partial RoPE, a quarter of each head, base 1e7, and the sigmoid output gate), the other 18
Gated DeltaNet layers with 16 key and 16 value heads of 128 and a 4-wide convolution, head tied), written as the
text model alone (`qwen3_5_text`, llama.cpp's `qwen35`) with plain RoPE where the original's text positions use
M-RoPE's equal sections. Its tensors' names and shapes are transformers' own (its model built without memory).
"""

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

VOCAB = 49152
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0}
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0}
QWEN35 = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
}
SHAPES = {  # name -> config.json's shape entries
    "llama-1b": {**LLAMA, "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 5632, "tie_word_embeddings": False},
    "llama-3b": {**LLAMA, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "tie_word_embeddings": True},
    "qwen3-4b": {**QWEN3, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen35-0.8b": {**QWEN35, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 3584, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "tie_word_embeddings": True},
    "qwen35-tiny": {**QWEN35, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "linear_num_key_heads": 4,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                    "tie_word_embeddings": True},
    "tiny": {**LLAMA, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "tie_word_embeddings": False},
}  # fmt: skip
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def layer_tensors(config: dict, i: int) -> dict[str, tuple]:
    """Layer i's tensors: names -> shapes, as transformers names them."""
    if config["model_type"] == "qwen3_5_text":
        return {name: shape for name, shape in hybrid_tensors(json.dumps(config)).items() if f".layers.{i}." in name}
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, ffn = config["head_dim"], config["intermediate_size"]
    p = f"model.layers.{i}."
    tensors = {
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": (ffn, hidden),
        p + "mlp.up_proj.weight": (ffn, hidden),
        p + "mlp.down_proj.weight": (hidden, ffn),
    }
    if config["model_type"] == "qwen3":
        tensors |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    return tensors


@functools.cache
def hybrid_tensors(config: str) -> dict[str, tuple]:
    """Every tensor of a Qwen3.5 text model of `config` (JSON): names -> shapes, from transformers' model of it built
    on the meta device (no memory for the weights)."""
    import torch
    import transformers

    known = {k: v for k, v in json.loads(config).items() if k not in ("model_type", "architectures", "torch_dtype")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**known))
    return {name: tuple(w.shape) for name, w in model.state_dict().items()}


def write_folder(folder: Path, name: str, seed: int = 0) -> None:
    """A random model of shape `name` as a Hugging Face folder, a shard at a time (never the whole model in memory)."""
    from compare import smollm2_gguf
    from llamacpp import smollm2_tokenizer
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shape = SHAPES[name]
    config = {
        **shape,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    if "full_attention_interval" in shape:  # every interval-th layer attends, the others are Gated DeltaNet layers
        every, layers = shape["full_attention_interval"], shape["num_hidden_layers"]
        config["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    folder.mkdir(parents=True, exist_ok=True)
    shards = [
        {"model.embed_tokens.weight": (VOCAB, shape["hidden_size"]), "model.norm.weight": (shape["hidden_size"],)}
    ]
    if not shape["tie_word_embeddings"]:
        shards[0]["lm_head.weight"] = (VOCAB, shape["hidden_size"])
    shards += [layer_tensors(config, i) for i in range(shape["num_hidden_layers"])]
    index = {}
    for k, tensors in enumerate(shards):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        arrays = {}
        for tensor, dims in tensors.items():
            if len(dims) == 1:
                arrays[tensor] = (1 + 0.1 * rng.standard_normal(dims)).astype(np.float16)
            else:
                arrays[tensor] = (rng.standard_normal(dims, np.float32) / np.sqrt(dims[-1])).astype(np.float16)
            index[tensor] = file
        save_file(arrays, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for part in smollm2_tokenizer(smollm2_gguf()).iterdir():
        if part.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(part, folder / part.name)


def build(name: str, ftype: str, folder: Path, llama_quantize: Path | None = None) -> Path:
    """`folder/name-ftype.gguf`, made now (with its F16 file) unless it is there."""
    from llamacpp import convert, llamacpp_tool

    target = folder / f"{name}-{ftype}.gguf"
    if target.is_file():
        return target
    source = folder / f"{name}-F16.gguf"
    if not source.is_file():
        hf = folder / f"{name}-hf"
        write_folder(hf, name)
        flags = ["--no-mtp"] if SHAPES[name]["model_type"] == "qwen3_5_text" else []  # no multi-token-prediction layer
        convert([(hf, "f16", source, flags)])
        shutil.rmtree(hf)
    quantize = str(llama_quantize or llamacpp_tool("llama-quantize"))
    threads = str(os.cpu_count() or 1)
    subprocess.run([quantize, str(source), str(target), ftype, threads], check=True, capture_output=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/minimlx-bench/synthetic"))
    parser.add_argument("--models", default="llama-1b,llama-3b,qwen3-4b")
    parser.add_argument("--types", default=",".join(TYPES))
    args = parser.parse_args()
    for name in args.models.split(","):
        for ftype in args.types.split(","):
            print(build(name, ftype, args.folder))


if __name__ == "__main__":
    main()
