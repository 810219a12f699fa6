"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from tiny random Hugging Face models.

Each model is converted to f32 and q8_0, once per session. The f32 file must give the logits minimlx computes
from the source folder; the q8_0 file those of transformers reading the same file, or, where transformers cannot
read the architecture (deepseek2), those of the file's tensors dequantized by gguf-py, llama.cpp's reference code.
transformers' GGUF reader drops some settings (head_dim, biases, the expert size, GPT-2's positions, and the
Llama 3.1 RoPE scaling that llama.cpp keeps as a `rope_freqs` tensor): the source config's values are given back
to it. The tokenizer is SmolLM2's, one the converter recognises; hence the 49152-token vocabulary.
"""

import functools
import json
import re

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import load_gguf
from llamacpp import Reader
from llamacpp_models import MODELS, ids_of, logits_of
from reference import (
    reference_logits,
    relative_error,
    require,
)

import minimlx
from minimlx.archs import get_arch, get_gguf_arch
from minimlx.errors import UnsupportedArchitectureError
from minimlx.io.gguf_file import read_gguf


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_f32_file_matches_the_source_model(converted, name):
    *_, architecture, markers, _ = MODELS[name]
    path = converted / f"{name}-f32.gguf"
    tensors, metadata = read_gguf(path, mx.float32)  # what load_gguf(path, "float32") reads
    assert metadata["general.architecture"] == architecture and all(marker in tensors for marker in markers)
    ids = ids_of(name)
    logits, model = logits_of(path, tensors, metadata, ids)
    assert type(model.config) is get_arch(json.loads((converted / name / "config.json").read_text())["model_type"])
    source = minimlx.load_model(converted / name, "float32")
    assert relative_error(logits, np.array(source(mx.array(ids)))) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, spec in MODELS.items() if spec[-1] is not None])
def test_q8_0_file_matches_transformers_reading_it(converted, name):
    torch, transformers, gguf = require("torch"), require("transformers"), require("gguf")
    require("accelerate")
    path = converted / f"{name}-q8_0.gguf"
    with pytest.MonkeyPatch.context() as patch:  # minimlx's subclass of gguf's reader (3x faster), read once
        patch.setattr(gguf, "GGUFReader", functools.cache(Reader))
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **MODELS[name][-1]
        )
    model, _ = load_gguf(path, "float32")
    ids = ids_of(name)
    assert relative_error(np.array(model(mx.array(ids))), reference_logits(reference, ids)) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, spec in MODELS.items() if spec[-1] is None])
def test_q8_0_file_matches_its_reference_dequantization(converted, name):
    """Packed weights (experts, per-head key and value maps) run as the floats llama.cpp's own code unpacks."""
    from gguf.quants import dequantize

    path = converted / f"{name}-q8_0.gguf"
    tensors, metadata = read_gguf(path, mx.float32)
    assert any(key.endswith(".scales") for key in tensors)  # packed, as minimlx reads Q8_0
    reference = {t.name: mx.array(dequantize(t.data, t.tensor_type).astype(np.float32)) for t in Reader(path).tensors}
    ids = ids_of(name)
    logits, _ = logits_of(path, tensors, metadata, ids)
    assert relative_error(logits, logits_of(path, reference, metadata, ids)[0]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["float", "q8_0"])
def test_deepseek2_file_with_a_fused_kv_b_loads(converted, packed):
    """Files converted before llama.cpp split attn_kv_b into attn_k_b and attn_v_b (and before the *_length_mla
    keys) load as the split ones do; a packed attn_kv_b is unpacked to be split."""
    path = converted / "deepseek_v2_lite-f32.gguf"
    tensors, metadata = read_gguf(path, mx.float32)
    metadata = {k: v for k, v in metadata.items() if not k.endswith("_length_mla")}
    config = MODELS["deepseek_v2_lite"][1]
    metadata["deepseek2.attention.key_length"] = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    metadata["deepseek2.attention.value_length"] = config["v_head_dim"]
    fused, dequantized = dict(tensors), {}
    for i in range(config["num_hidden_layers"]):
        k_b, v_b = fused.pop(f"blk.{i}.attn_k_b.weight"), fused.pop(f"blk.{i}.attn_v_b.weight")
        # (heads, latent, nope) and (heads, value, latent) -> (heads * (nope + value), latent)
        kv_b = mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])
        name = f"blk.{i}.attn_kv_b"
        if packed:
            w, scales, biases = mx.quantize(kv_b, group_size=32, bits=8)
            fused.update({f"{name}.weight": w, f"{name}.scales": scales, f"{name}.biases": biases})
            kv_b = mx.dequantize(w, scales, biases, group_size=32, bits=8)
        else:
            fused[f"{name}.weight"] = kv_b
        dequantized[f"{name}.weight"] = kv_b
    # the split file's logits; for a packed attn_kv_b, those of the float one it unpacks to
    expected = {**{k: v for k, v in fused.items() if ".attn_kv_b." not in k}, **dequantized} if packed else tensors
    logits, _ = logits_of(path, fused, metadata)
    assert relative_error(logits, logits_of(path, expected, metadata)[0]) <= 1e-5


def test_gguf_architecture_without_a_plugin_lists_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'mamba' has no plugin") as error:
        get_gguf_arch("mamba")
    listed = re.search(r"GGUF architectures supported: ([^)]*)\)", str(error.value))[1].split(", ")
    assert {"deepseek2", "gpt2", "llama", "qwen3", "qwen3moe"} <= set(listed)


@pytest.mark.slow
def test_mxfp4_experts_are_mlx_mxfp4_bit_for_bit(converted):
    """gpt-oss's MXFP4 experts stay packed, as MLX's mxfp4 (uint8 exponents, no biases), and unpack to exactly the
    values llama.cpp's reference code gives."""
    from gguf.quants import dequantize

    path = converted / "gpt_oss-f32.gguf"
    tensors, _ = read_gguf(path)
    packed = [t for t in Reader(path).tensors if t.tensor_type.name == "MXFP4"]
    assert len(packed) == 3 * MODELS["gpt_oss"][1]["num_hidden_layers"]
    for t in packed:
        stem = t.name.removesuffix(".weight")
        scales = tensors[f"{stem}.scales"]
        assert scales.dtype == mx.uint8 and f"{stem}.biases" not in tensors
        w = mx.dequantize(tensors[t.name], scales, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
        assert np.array_equal(np.array(w), dequantize(t.data, t.tensor_type))
