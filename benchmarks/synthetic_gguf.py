"""The benchmarks' standard synthetic GGUF files: a LLaMA-shaped 1B and 3B, a Qwen3-shaped 4B, a Gemma-4-shaped 1B
(dense), a GLM-4.5-shaped 1B (MoE) and a Qwen3.5-shaped 0.8B (hybrid) of random weights, as Hugging Face folders
(float16 safetensors, a shard per layer), converted to F16 by llama.cpp's own converter and quantized by its
`llama-quantize` to Q4_K_M, Q5_K_M, Q6_K and Q8_0, as a user's downloads are.

    python benchmarks/synthetic_gguf.py [--folder DIR] [--models llama-1b,gemma4-1b,glm45-1b,...] [--types Q4_K_M,...]

Files already in the folder are kept (the F16 file of a 4B is 8 GB; each takes minutes on 2 cores). The shapes are
TinyLlama-1.1B's, Llama-3.2-3B's and Qwen3-4B's with SmolLM2's 49,152-token vocabulary (the converter must know the
tokenizer; the weights' bytes per token differ from the originals' only in the embedding and head). The tensors are
the ones transformers saves for each config (its model built without memory, its names and shapes read off).

The two 2026 shapes follow the layouts transformers 5.25 documents with its configs' defaults, narrowed to about 1B
parameters with the same vocabulary:
- `gemma4-1b`: `Gemma4TextConfig`'s (documented against google/gemma-4-e2b-it): 8 query and 4 key-value heads of 256
  (512 in the global layers), five sliding-window layers (window 512) to one global layer with proportional RoPE on a
  quarter of each head, per-layer input embeddings of 256 per layer, GELU FFN 4x the width, tied head; the width 2304
  -> 1536 and 30 -> 24 layers (1.0B parameters besides the per-layer embeddings' 0.3B, a lookup per token). Its
  vocabulary is a SentencePiece-style one made for it (llama.cpp's Gemma 4 converter reads byte-fallback BPE only).
- `glm45-1b`: `Glm4MoeConfig`'s (GLM-4.5-Air's layout): a dense first layer, then sigmoid-routed experts with a
  correction bias, 8 of them per token, and one shared expert; 128-wide heads with RoPE on half of each, q/k/v biases,
  8 query heads per key-value head; untied head. The width 4096 -> 1024, 46 -> 16 layers, 96/8 -> 16/2 heads, 128 ->
  64 experts of 1408 -> 256 (0.95B parameters, 0.27B active), no multi-token-prediction layer.
- `qwen35-0.8b`: the text model of Qwen3.5-0.8B's published config.json (`text_config` of Qwen/Qwen3.5-0.8B, as
  quoted in several public repositories): hidden 1024, FFN 3584, 24 layers of which every 4th attends with 8 query
  heads and 2 key-value heads of 256 (partial RoPE, a quarter of each head, base 1e7, and the sigmoid output gate),
  the other 18 Gated DeltaNet layers with 16 key and 16 value heads of 128 and a 4-wide convolution, head tied;
  written as the text model alone (`qwen3_5_text`, llama.cpp's `qwen35`) with plain RoPE where the original's text
  positions use M-RoPE's equal sections, converted without the multi-token-prediction layer.
`gemma4-tiny`, `glm45-tiny` and `qwen35-tiny` are the same recipes at test size.
"""

import argparse
import json
import os
import re
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
GEMMA4 = {
    "model_type": "gemma4_text",
    "architectures": ["Gemma4ForCausalLM"],
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_size_per_layer_input": 256,
    "sliding_window": 512,
}
GLM45 = {
    "model_type": "glm4_moe",
    "architectures": ["Glm4MoeForCausalLM"],
    "head_dim": 128,
    "attention_bias": True,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
}
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
    "gemma4-1b": {**GEMMA4, "hidden_size": 1536, "num_hidden_layers": 24, "intermediate_size": 6144},
    "glm45-1b": {**GLM45, "hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
                 "num_key_value_heads": 2, "intermediate_size": 2816, "n_routed_experts": 64,
                 "moe_intermediate_size": 256},
    "qwen35-0.8b": {**QWEN35, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 3584, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "tie_word_embeddings": True},
    "tiny": {**LLAMA, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "tie_word_embeddings": False},
    "gemma4-tiny": {**GEMMA4, "hidden_size": 256, "num_hidden_layers": 6, "intermediate_size": 1024,
                    "sliding_window": 16},
    "glm45-tiny": {**GLM45, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 512, "n_routed_experts": 16,
                   "num_experts_per_tok": 4, "moe_intermediate_size": 256},
    "qwen35-tiny": {**QWEN35, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "linear_num_key_heads": 4,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                    "tie_word_embeddings": True},
}  # fmt: skip
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def model_config(name: str) -> dict:
    """config.json of shape `name`, every setting written out (transformers' config of the shape's entries)."""
    import transformers

    shape = SHAPES[name]
    vocab = VOCAB + (len(glm_tokens()) if shape["model_type"] == "glm4_moe" else 0)
    entries = {
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **({"hidden_act": "silu"} if shape["model_type"] != "gemma4_text" else {}),
        **({"vocab_size_per_layer_input": vocab, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
           if shape["model_type"] == "gemma4_text" else {}),
        **shape,
    }  # fmt: skip
    config = transformers.AutoConfig.for_model(**entries).to_dict()
    return {**config, "architectures": shape["architectures"], "torch_dtype": "float16"}


def saved_tensors(config: dict) -> dict[str, tuple]:
    """The tensors transformers saves for `config`: names -> shapes (its model built on the meta device, so without
    memory, and its weights put back in the checkpoint layout as `save_pretrained` does)."""
    import torch
    import transformers
    from transformers.modeling_utils import revert_weight_conversion

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    state = revert_weight_conversion(model, model.state_dict())
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in state.items()}


def shards(tensors: dict[str, tuple], layers: int) -> list[dict[str, tuple]]:
    """The tensors a shard per layer, the ones outside the layers first."""
    per_layer = [{} for _ in range(layers + 1)]
    for name, shape in tensors.items():
        match = re.search(r"\.layers\.(\d+)\.", name)
        per_layer[int(match[1]) + 1 if match else 0][name] = shape
    return [shard for shard in per_layer if shard]


def glm_tokens() -> tuple:
    from families_2026 import GLM_TOKENS

    return GLM_TOKENS


def write_tokenizer(folder: Path, model_type: str) -> None:
    """The tokenizer llama.cpp's converter takes for the family: SmolLM2's (GLM-4.5's with the special tokens its
    converter looks up), or for Gemma 4 a byte-fallback BPE of as many tokens, pieces made by merging earlier ones."""
    if model_type == "gemma4_text":
        import transformers

        vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
        letters = list("▁abcdefghijklmnopqrstuvwxyz")
        vocab.update({c: len(vocab) + i for i, c in enumerate(letters)})
        merges, pieces, rng = [], letters[:], np.random.default_rng(0)
        while len(vocab) < VOCAB:
            a, b = pieces[rng.integers(len(pieces))], letters[rng.integers(len(letters))]
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
                pieces.append(a + b)
        transformers.GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(folder)
        return
    from compare import smollm2_gguf
    from llamacpp import smollm2_tokenizer

    for part in smollm2_tokenizer(smollm2_gguf()).iterdir():
        if part.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(part, folder / part.name)
    if model_type == "glm4_moe":
        from llamacpp_models import add_token

        add_token(folder, *glm_tokens())


def write_folder(folder: Path, name: str, seed: int = 0) -> None:
    """A random model of shape `name` as a Hugging Face folder, a shard at a time (never the whole model in memory)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    config = model_config(name)
    folder.mkdir(parents=True, exist_ok=True)
    parts = shards(saved_tensors(config), config["num_hidden_layers"])
    index = {}
    for k, tensors in enumerate(parts):
        file = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        arrays = {}
        for tensor, dims in tensors.items():
            if len(dims) <= 1:
                arrays[tensor] = (1 + 0.1 * rng.standard_normal(dims)).astype(np.float16)
            else:
                arrays[tensor] = (rng.standard_normal(dims, np.float32) / np.sqrt(dims[-1])).astype(np.float16)
            index[tensor] = file
        save_file(arrays, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, config["model_type"])


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
