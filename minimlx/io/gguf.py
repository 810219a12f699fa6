"""GGUF files (llama.cpp's format): config from the metadata, weights as MLX loads them.

`mx.load` returns F32/F16 tensors as arrays and Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized
triples `name.weight` (packed uint32), `name.scales`, `name.biases` with groups of 32 along the
input dimension; the conversion is exact. Other llama.cpp quantizations (K-quants) come back as
float16.

Two layout details differ from Hugging Face checkpoints:
- llama.cpp's converter permutes the rows of each head of the q and k projections so that
  interleaved ("traditional") RoPE reproduces rotate-half RoPE. `unpermute_rows` undoes it, so the
  llama plugin runs unchanged. Groups run along the input dimension, so the same row permutation
  applies to packed weights, scales and biases alike.
- A file without `output.weight` ties the head to the token embedding.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import CheckpointError, InvalidSettingError, UnsupportedArchitectureError
from .checkpoint import DTYPES, build_model, check_weights, install_weights
from .names import rename

SUPPORTED = ("llama",)

GGUF_NAMES = [
    (r"^token_embd\.", "embed."),
    (r"^output_norm\.", "norm."),
    (r"^output\.", "head."),
    (r"^blk\.(\d+)\.attn_norm\.", r"layers.\1.attn_norm."),
    (r"^blk\.(\d+)\.attn_q\.", r"layers.\1.attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"layers.\1.attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"layers.\1.attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"layers.\1.attn.o_proj."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"layers.\1.ffn_norm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"layers.\1.ffn.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"layers.\1.ffn.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"layers.\1.ffn.down_proj."),
]


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """Tensors and metadata of a GGUF file; scalar metadata as Python numbers."""
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except Exception as e:
        reason = str(e).removeprefix("[load_gguf] ")
        raise CheckpointError(
            f"cannot read GGUF file {path}: {reason} (supported tensor types: F32, F16, BF16, Q4_0, Q4_1, Q8_0, "
            "K-quants); re-download or re-convert it"
        ) from None
    metadata = {k: v.item() if isinstance(v, mx.array) and v.ndim == 0 else v for k, v in metadata.items()}
    return weights, metadata


def gguf_config(metadata: dict, tied_head: bool) -> dict:
    """The Hugging Face style config dict that the GGUF metadata describes."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported yet (supported: {', '.join(SUPPORTED)}); "
            "use a Hugging Face checkpoint folder of the model instead"
        )

    def get(key, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete, re-convert it")
        return value

    dims, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", dims // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedArchitectureError("GGUF files with partial rotary embeddings are not supported yet")
    return {
        "model_type": "llama",
        "vocab_size": get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
        "hidden_size": dims,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(metadata, arch),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": tied_head,
    }


def rope_scaling(metadata: dict, arch: str) -> dict | None:
    """`{arch}.rope.scaling.*` (or the older `rope.scale_linear`) as a Hugging Face `rope_scaling` dict."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "none" and metadata.get(f"{arch}.rope.scale_linear", 1.0) != 1.0:
        kind, factor = "linear", metadata[f"{arch}.rope.scale_linear"]
    if kind == "none" or factor in (None, 1.0):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedArchitectureError(f"GGUF rope scaling {kind!r} is not supported yet (supported: linear, yarn)")
    scaling = {"rope_type": kind, "factor": factor}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to rotate-half order (halves)."""
    rows = w.shape[0] // heads
    return w.reshape(heads, rows // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantization(weights: dict[str, mx.array], model: nn.Module) -> dict[str, dict]:
    """Group size and bits of each quantized module (keyed by module path), from the tensor shapes."""
    params = dict(tree_flatten(model.parameters()))
    found = {}
    for name, scales in weights.items():
        module = name.removesuffix(".scales")
        if name.endswith(".scales") and f"{module}.weight" in params:  # others: reported as unexpected
            in_dims = params[f"{module}.weight"].shape[-1]
            bits = weights[f"{module}.weight"].shape[-1] * 32 // in_dims
            found[module] = {"group_size": in_dims // scales.shape[-1], "bits": bits}
    return found


def dequantize(packed: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """float32 `scale * q + bias` per group: the same numbers as `mx.dequantize`, several times faster on the CPU."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = (packed[..., None] >> shifts) & (2**bits - 1)
    q = q.reshape(*scales.shape, -1).astype(mx.float32)
    w = q * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return w.reshape(*packed.shape[:-1], -1)


def dequantize_all(weights: dict[str, mx.array], quantized: dict[str, dict]) -> dict[str, mx.array]:
    """Replace each quantized triple by its float32 matrix (computed in float32, as llama.cpp does)."""
    weights = dict(weights)
    for module, q in quantized.items():
        scales, biases = weights.pop(f"{module}.scales"), weights.pop(f"{module}.biases")
        weights[f"{module}.weight"] = dequantize(weights[f"{module}.weight"], scales, biases, q["bits"])
    return weights


def load_gguf(path: str | Path, dtype: str | None = None) -> tuple[nn.Module, dict]:
    """A minimlx model and the file's metadata (which also holds the tokenizer).

    `dtype` None or "quantized" keeps Q4_0/Q4_1/Q8_0 tensors quantized (QuantizedLinear,
    QuantizedEmbedding) and runs everything else in the dtype of their scales (float16; float32 on the CPU);
    "float32", "float16" or "bfloat16" dequantizes every tensor to that dtype.
    """
    if dtype not in (None, "quantized", *DTYPES):
        raise InvalidSettingError(f"unknown dtype {dtype!r}; use quantized, {', '.join(DTYPES)}")
    raw, metadata = read_gguf(path)
    if "rope_freqs.weight" in raw:
        raise UnsupportedArchitectureError(
            f"{path} uses per-frequency RoPE factors (rope_freqs, Llama 3.1+), which GGUF loading does not support "
            "yet; use the Hugging Face checkpoint folder of the model instead"
        )
    model = build_model(gguf_config(metadata, tied_head="output.weight" not in raw))
    arch = model.config
    source = rename({name: name for name in raw}, GGUF_NAMES)  # model name -> GGUF name
    weights = {name: raw[gguf_name] for name, gguf_name in source.items()}
    for name in weights:
        if ".attn.q_proj." in name or ".attn.k_proj." in name:
            heads = arch.heads if ".q_proj." in name else arch.kv_heads
            weights[name] = unpermute_rows(weights[name], heads)

    quantized = quantization(weights, model)
    if dtype in (None, "quantized"):
        nn.quantize(model, class_predicate=lambda module, _: quantized.get(module, False))
        on_cpu = mx.default_device() == mx.cpu  # MLX's CPU quantized matmul is ~30x slower with float16 scales
        execution = mx.float32 if on_cpu else next((weights[f"{m}.scales"].dtype for m in quantized), None)
    else:
        weights = dequantize_all(weights, quantized)
        execution = DTYPES[dtype]
    check_weights(model, weights, {id(weights[n]): g for n, g in source.items() if n in weights})
    install_weights(model, weights, execution)
    return model, metadata
