"""What plugins share to read GGUF files: metadata under the architecture's prefix, and llama.cpp's layouts.

llama.cpp keeps hyperparameters under `{architecture}.{key}` metadata keys, names tensors `blk.{i}.*`,
and stores weights row-major as Hugging Face does, except that its converter permutes the q and k
rows of LLaMA-style models for interleaved RoPE (`unpermute_rows` undoes that). A file without
`output.weight` ties the head to the token embedding.
"""

import mlx.core as mx

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..quantization import dequantize_stored


class Metadata:
    """`metadata[key]` looks up `{architecture}.{key}`, with a clear error when a required key is missing."""

    def __init__(self, metadata: dict):
        self.metadata = metadata
        self.arch = metadata.get("general.architecture")

    def get(self, key: str, default=None):
        return self.metadata.get(f"{self.arch}.{key}", default)

    def __getitem__(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {self.arch}.{key}; the file is incomplete, re-convert it")
        return value


def llama_config(metadata: dict, tensors: dict, model_type: str) -> dict:
    """The Hugging Face config keys every LLaMA-like GGUF carries: sizes, attention, norms, RoPE, head."""
    m = Metadata(metadata)
    dims, heads = m["embedding_length"], m["attention.head_count"]
    head_dim = m.get("attention.key_length", dims // heads)
    rope_dims = m.get("rope.dimension_count", head_dim)
    return {
        "model_type": model_type,
        "vocab_size": m.get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ()))),
        "hidden_size": dims,
        "num_hidden_layers": m["block_count"],
        "intermediate_size": m["feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": m.get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": m.get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": m.get("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(m, tensors.get("rope_freqs.weight"), rope_dims),
        "max_position_embeddings": m.get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }


def hybrid_layers(config: dict, recurrent: str, attention: str) -> dict:
    """`num_key_value_heads` and `layer_types` (kinds `recurrent` and `attention`) of a hybrid whose file marks its
    recurrent layers by zero key-value heads: `attention.head_count_kv` one entry per layer (LFM2's, Granite 4's)."""
    heads, layers = config["num_key_value_heads"], config["num_hidden_layers"]
    heads = heads if isinstance(heads, list) else [heads] * layers
    if len(heads) != layers or not any(heads):
        raise CheckpointError(
            f"GGUF attention.head_count_kv {heads} must give each of {layers} layers its key-value heads (0 for a "
            "recurrent layer), some layer attending; the file is corrupt, re-convert it"
        )
    kinds = [attention if n else recurrent for n in heads]
    return {**config, "num_key_value_heads": max(heads), "layer_types": kinds}


def moe_config(m: Metadata) -> dict:
    """DeepSeek's mixture-of-experts config keys (DeepSeek-MoE, V2, V3, GLM-4.5) from llama.cpp's expert keys."""
    return {
        "n_routed_experts": m["expert_count"],
        "num_experts_per_tok": m["expert_used_count"],
        "moe_intermediate_size": m["expert_feed_forward_length"],
        "n_shared_experts": m.get("expert_shared_count", 0),
        "first_k_dense_replace": m.get("leading_dense_block_count", 0),
        "routed_scaling_factor": m.get("expert_weights_scale", 1.0),
        "n_group": m.get("expert_group_count") or 1,
        "topk_group": m.get("expert_group_used_count") or 1,
        "norm_topk_prob": m.get("expert_weights_norm", False),
    }


def windows(m: Metadata, pattern: int, window: int | None = None) -> dict:
    """The sliding window and the layers it covers, as config keys: `attention.sliding_window` (`window` without
    it; 0 means none) and `attention.sliding_window_pattern`, every n-th layer global or a flag per layer (`pattern`
    without it, as llama.cpp assumes for each family)."""
    layout = m.get("attention.sliding_window_pattern", pattern)
    config = {"sliding_window": m.get("attention.sliding_window", window) or None}
    if isinstance(layout, list):
        return {**config, "layer_types": ["sliding_attention" if s else "full_attention" for s in layout]}
    return {**config, "sliding_window_pattern": layout}


def partial_rotary(m: Metadata, config: dict) -> dict:
    """`partial_rotary_factor`: the share of each head that `rope.dimension_count` rotates."""
    return {**config, "partial_rotary_factor": m.get("rope.dimension_count", config["head_dim"]) / config["head_dim"]}


def rope_scaling(m: Metadata, rope_freqs: mx.array | None, rope_dims: int) -> dict | None:
    """`rope.scaling.*` (or the older `rope.scale_linear`) as a Hugging Face `rope_scaling` dict.

    Llama 3.1+ files carry their llama3 scaling as a `rope_freqs` tensor instead: one factor per rotated
    pair, by which that pair's wavelength is multiplied (what llama.cpp applies).
    """
    if rope_freqs is not None:
        if rope_freqs.shape != (rope_dims // 2,) or not bool((rope_freqs > 0).all()):
            raise CheckpointError(
                f"GGUF rope_freqs has shape {tuple(rope_freqs.shape)}, but rope.dimension_count {rope_dims} needs "
                f"{rope_dims // 2} positive factors; the file is corrupt, re-convert it"
            )
        return {"rope_type": "per_frequency", "factors": rope_freqs.astype(mx.float32).tolist()}
    kind = m.get("rope.scaling.type", "none")
    factor = m.get("rope.scaling.factor")
    if kind == "none" and m.get("rope.scale_linear", 1.0) != 1.0:
        kind, factor = "linear", m.get("rope.scale_linear")
    if kind == "none" or factor in (None, 1.0):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedArchitectureError(f"GGUF rope scaling {kind!r} is not supported yet (supported: linear, yarn)")
    scaling = {"rope_type": kind, "factor": factor}
    for key, name in YARN_KEYS.items():
        if (value := m.get(key)) is not None:
            scaling[name] = value
    return scaling


# llama.cpp's `rope.scaling.*` keys -> Hugging Face `rope_scaling` keys
YARN_KEYS = {
    "rope.scaling.original_context_length": "original_max_position_embeddings",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
    "rope.scaling.yarn_attn_factor": "attention_factor",
}


def unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to rotate-half order (halves).

    Groups of packed weights run along the input dimension, so the same row permutation applies to
    packed weights, scales and biases alike.
    """
    rows = w.shape[0] // heads
    return w.reshape(heads, rows // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpacked(weights: dict, name: str, in_dims: int | None = None) -> mx.array:
    """Remove tensor `name` (`X.weight`, of `in_dims` columns where known) from `weights` and return it as floats,
    dequantized if GGUF packed it (`X.scales` and `X.biases` beside it, groups of 32, or its blocks as stored) in
    float32, not in the scales' float16: for layouts that need a transpose or re-order their columns."""
    w, stem = weights.pop(name), name.removesuffix(".weight")
    if w.dtype == mx.uint8:  # held as the file's blocks (io/gguf_file.py's `stored`)
        return dequantize_stored(w, in_dims)
    if f"{stem}.scales" not in weights:
        return w
    scales, biases = weights.pop(f"{stem}.scales"), weights.pop(f"{stem}.biases")
    bits = w.shape[-1] // scales.shape[-1]  # a group of 32 values fills `bits` words
    return mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
