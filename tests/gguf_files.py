"""Small GGUF files written with gguf's GGUFWriter: a random llama with llama.cpp's tensor names and q/k permutation,
and files holding given raw tensors."""

from pathlib import Path

import numpy as np
from reference import require

from minimlx import loading

gguf = require("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (interleaved RoPE pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, tensor_type: str, tied: bool = False, architecture: str = "llama", seed: int = 0):
    """A random transformers llama saved as GGUF: matrices in `tensor_type`, norms in F32."""
    torch, transformers, gguf = require("torch"), require("transformers"), require("gguf")
    from gguf.quants import quantize

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(CONFIG["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in LAYER_NAMES.items()})

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    writer.add_rope_freq_base(CONFIG["rope_theta"])
    writer.add_rope_dimension_count(CONFIG["hidden_size"] // CONFIG["num_attention_heads"])
    writer.add_vocab_size(CONFIG["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    kind = gguf.GGMLQuantizationType[tensor_type]
    state = model.state_dict()
    for hf_name, gguf_name in names.items():
        w = state[hf_name].float().numpy()
        if ".attn_q." in gguf_name:
            w = llama_cpp_permute(w, CONFIG["num_attention_heads"])
        if ".attn_k." in gguf_name:
            w = llama_cpp_permute(w, CONFIG["num_key_value_heads"])
        if w.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(gguf_name, w)
        elif tensor_type == "F16":
            writer.add_tensor(gguf_name, w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF file holding `tensors`: name -> (data as stored, type name)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=T[kind] if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_gguf(path, dtype: str | None = None):
    """A GGUF file as a model, and the file's metadata: what `minimlx.load` reads of it, less the tokenizer. Through
    `loading.read_checkpoint`, so that a test can stand in for `loading.read_gguf`."""
    checkpoint = loading.read_checkpoint(Path(path), dtype)
    return loading.assemble(checkpoint, dtype), checkpoint.metadata


def reference_tensors(path) -> dict:
    """Every tensor of the GGUF file at `path` in float32 as gguf-py, llama.cpp's reference code, dequantizes it: the
    bytes at the offsets minimlx's header parser finds (gguf's GGUFReader spends seconds on a 49k-token
    vocabulary)."""
    import mlx.core as mx
    from gguf.quants import dequantize

    from minimlx.io.gguf_file import GGUFFile, nbytes

    file, data = GGUFFile(path), np.memmap(path, mode="r")
    tensors = {}
    for name, (kind, shape, offset) in file.tensors.items():
        start = file.start + offset
        raw = np.array(data[start : start + nbytes(kind, shape)]).reshape(*shape[:-1], -1)
        tensors[name] = mx.array(dequantize(raw, kind).astype(np.float32))
    return tensors
