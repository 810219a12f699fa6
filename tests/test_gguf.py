"""GGUF loading: small random llama models written with gguf's GGUFWriter, checked against transformers
reading the same file (it undoes llama.cpp's q/k permutation and dequantizes on its own)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from reference import reference_logits, relative_error, require

from minimlx.errors import CheckpointError, UnsupportedArchitectureError
from minimlx.loading import load_gguf

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
