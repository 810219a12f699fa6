"""GGUF loading: small random llama models written with gguf's GGUFWriter, checked against transformers
reading the same file (it undoes llama.cpp's q/k permutation and dequantizes on its own)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf_files import CONFIG, load_gguf, write_gguf
from reference import reference_logits, relative_error, require

from minimlx.errors import CheckpointError, UnsupportedArchitectureError
from minimlx.loading import stored_blocks


def stored_names() -> set[str]:
    """The GGUF types a quantized CPU load holds as stored (with the native kernel)."""
    return {GGMLQuantizationType(t).name for t in stored_blocks("quantized")}


def transformers_from_gguf(path):
    torch, transformers = require("torch"), require("transformers")
    require("accelerate")  # transformers needs it to read GGUF
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


IDS = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(2, 12))


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_matches_transformers_in_float32(tmp_path, tensor_type):
    path = write_gguf(tmp_path / "model.gguf", tensor_type)
    model, metadata = load_gguf(path, "float32")
    assert metadata["general.architecture"] == "llama"
    assert not model.tied_head
    assert all(v.dtype == mx.float32 for _, v in nn.utils.tree_flatten(model.parameters()))
    ours = np.array(model(mx.array(IDS)))
    assert relative_error(ours, reference_logits(transformers_from_gguf(path), IDS)) < 1e-5


def test_gguf_without_output_ties_the_head(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "Q8_0", tied=True)
    model, _ = load_gguf(path, "float32")
    assert model.tied_head
    ours = np.array(model(mx.array(IDS)))
    assert relative_error(ours, reference_logits(transformers_from_gguf(path), IDS)) < 1e-5


@pytest.mark.parametrize("tensor_type, bits", [("Q8_0", 8), ("Q4_1", 4)])
def test_gguf_kept_quantized(tmp_path, tensor_type, bits):
    path = write_gguf(tmp_path / "model.gguf", tensor_type)
    model, _ = load_gguf(path, "quantized")
    q_proj = model.layers[0].attn.q_proj
    if tensor_type in stored_names():  # held as the file stores it, where the native kernel reads it so
        assert (q_proj.mode, q_proj.weight.dtype, model.embed.mode) == (tensor_type.lower(), mx.uint8, q_proj.mode)
    else:
        assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (bits, 32)
        assert isinstance(model.embed, nn.QuantizedEmbedding)
    on_cpu = mx.default_device() == mx.cpu  # float32 there: MLX's CPU quantized matmul is slow with float16 scales
    assert model.layers[0].attn_norm.weight.dtype == (mx.float32 if on_cpu else mx.float16)
    ours = np.array(model(mx.array(IDS)).astype(mx.float32))
    assert relative_error(ours, reference_logits(transformers_from_gguf(path), IDS)) < 2e-2


@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q5_K_S", "Q6_K"])
def test_llama_quantize_k_quant_files_match_transformers(kquant_llama, recipe):
    """Files as llama-quantize writes them (kquant_llama.py), K-quant types chosen per tensor."""
    path = kquant_llama[recipe]
    model, _ = load_gguf(path, "float32")
    ours = np.array(model(mx.array(IDS)))
    assert relative_error(ours, reference_logits(transformers_from_gguf(path), IDS)) < 5e-3


def test_unsupported_gguf_architecture(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "F32", architecture="mamba")
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'mamba' has no plugin"):
        load_gguf(path)


def test_truncated_gguf(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "Q4_0")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="cannot read GGUF file .*re-download"):
        load_gguf(path)
