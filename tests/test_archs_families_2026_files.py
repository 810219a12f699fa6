"""The 2025-26 families from the files other tools write of them: mlx-lm's own `convert` (float32, and 4-bit) and
llama.cpp's converter (f32, q8_0, and the Q4_K_M llama-quantize makes of the f32 file).

mlx-lm folders: minimlx (weights dequantized to float32, and kept packed) gives mlx-lm's own logits on the same
folder, and transformers' for the float32 one. Each family's config is the one of tests/families_2026.py, saved in
the layout mlx-lm reads for it (published checkpoints' keys).

GGUF files: the f32 file gives transformers' logits of the source model; the packed ones (the converter's q8_0, and
the Q4_K_M gguf_quantize.py writes of the f32 file as llama-quantize does; for DeepSeek V3.2 and Mistral 4,
llama-quantize's own) the logits of their tensors dequantized by gguf-py, llama.cpp's reference
code. llama.cpp's converter converts Mistral 4 only as the text of an image-text `Mistral3ForConditionalGeneration`
and writes no query temperature for it, which llama.cpp then does not apply: minimlx reads the file so too, and
applies a temperature a file holds as llama.cpp does.
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from families_2026 import GGUF_FAMILIES, GGUF_VOCAB, VOCAB, convert_families, family_config, save_family
from gguf_files import load_gguf
from llamacpp import llama_quantize
from mlx_lm_reference import mlx_lm_convert, mlx_lm_logits, save_tokenizer
from reference import random_ids, reference_logits, relative_error, to_v4_layout

import minimlx
from minimlx.io.gguf_file import read_gguf

# name -> (the family's config as mlx-lm can read it, whether mlx-lm reads it in transformers 4's layout). mlx-lm's
# olmo3 turns the sliding layers with the global RoPE base, unscaled (the published configs' one base); its minimax
# reads the published configs' shared_intermediate_size; its ministral3 attends to the whole text (as the published
# configs do, sliding_window null); its mistral3 reads an untied head (as published); its llama4_text is a dense
# model, so Llama 4 is read from the image-text checkpoint only.
MLX_LM = {
    "deepseek_v32": (family_config("deepseek_v32"), True),
    "glm4_moe": (family_config("glm4_moe"), True),
    "llama4": (family_config("llama4"), True),
    "minimax_m2": (family_config("minimax_m2", shared_intermediate_size=0), True),
    "ministral3": (family_config("ministral3", sliding_window=None), False),
    "mistral3": ({**family_config("mistral3", sliding_window=None), "tie_word_embeddings": False}, False),
    "mistral4": (family_config("mistral4"), False),
    "olmo3": (
        family_config(
            "olmo3",
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
            ),
        ),
        True,
    ),
}
MLX_LM_VARIANTS = {"float32": dict(dtype="float32"), "4bit": dict(quantize=True, q_bits=4, q_group_size=32)}


@pytest.fixture(scope="module", params=sorted(MLX_LM))
def mlx_lm_folders(request, tmp_path_factory):
    """(name, {variant: mlx-lm's folder}, transformers' logits, ids) of one family, converted once."""
    name = request.param
    config, v4_layout = MLX_LM[name]
    source = tmp_path_factory.mktemp(f"hf-{name}")
    torch_model = save_family(source, name, config)
    if v4_layout:
        to_v4_layout(source)
    save_tokenizer(source)
    root = tmp_path_factory.mktemp(f"mlx-{name}")
    folders = {variant: mlx_lm_convert(source, root / variant, **o) for variant, o in MLX_LM_VARIANTS.items()}
    ids = random_ids(VOCAB)
    return name, folders, reference_logits(torch_model, ids), ids


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(MLX_LM_VARIANTS))
def test_mlx_lm_folder_matches_mlx_lm(mlx_lm_folders, variant):
    _, folders, reference, ids = mlx_lm_folders
    expected = np.array(mlx_lm_logits(folders[variant], ids))
    for dtype in ("float32", "quantized"):
        model = minimlx.load_model(folders[variant], dtype=dtype)
        logits = np.array(model(mx.array(ids)).astype(mx.float32))
        assert relative_error(logits, expected) <= 1e-4, dtype
        if variant == "float32":
            assert relative_error(logits, reference) <= 1e-4, dtype


# the packed files of each architecture: Mistral 3's text model is Ministral 3's (`mistral3` files both)
PACKED = [name for name in GGUF_FAMILIES if name != "mistral3"]
LLAMA_QUANTIZED = ("deepseek_v32", "mistral3_mistral4")  # their Q4_K_M files: llama-quantize's


@pytest.fixture(scope="module")
def gguf_families(tmp_path_factory):
    """(root, {name: transformers' logits}, ids): every family converted once, to f32 and q8_0 (PACKED), the f32 file
    also quantized to Q4_K_M."""
    from gguf_quantize import quantize
    from llamacpp import Reader

    root = tmp_path_factory.mktemp("gguf-2026")
    models = convert_families(root, {name: ("f32", "q8_0") if name in PACKED else ("f32",) for name in GGUF_FAMILIES})
    for name in PACKED:
        source, target = root / f"{name}-f32.gguf", root / f"{name}-Q4_K_M.gguf"
        if name not in LLAMA_QUANTIZED:
            quantize(Reader(source), target, "Q4_K_M")
        else:
            subprocess.run([llama_quantize(), source, target, "Q4_K_M"], check=True, capture_output=True)
    ids = random_ids(GGUF_VOCAB)
    return root, {name: reference_logits(model, ids) for name, model in models.items()}, ids


@pytest.mark.slow
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_f32_gguf_matches_the_source_model(gguf_families, name):
    root, references, ids = gguf_families
    model, metadata = load_gguf(root / f"{name}-f32.gguf", "float32")
    assert metadata["general.architecture"] == GGUF_FAMILIES[name][1]
    assert relative_error(np.array(model(mx.array(ids))), references[name]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q8_0", "Q4_K_M"])
@pytest.mark.parametrize("name", PACKED)
def test_packed_gguf_matches_its_reference_dequantization(gguf_families, name, kind):
    """Packed weights (experts among them) read as the floats llama.cpp's own code unpacks; q8_0's kept packed too
    (Q4_K_M's Q6_K tensors are re-packed at 8 bits when kept packed: about 1e-3 off, formats.md)."""
    from gguf.quants import dequantize
    from llamacpp import Reader
    from llamacpp_models import logits_of

    root, _, ids = gguf_families
    path = root / f"{name}-{kind}.gguf"
    tensors, metadata = read_gguf(path, mx.float32)
    assert any(key.endswith(".scales") for key in tensors)
    reference = {t.name: mx.array(dequantize(t.data, t.tensor_type).astype(np.float32)) for t in Reader(path).tensors}
    logits, _ = logits_of(path, tensors, metadata, ids)
    expected = logits_of(path, reference, metadata, ids)[0]
    assert relative_error(logits, expected) <= 1e-4
    if kind == "q8_0":
        packed, _ = load_gguf(path, "quantized")
        assert relative_error(np.array(packed(mx.array(ids)).astype(mx.float32)), expected) <= 1e-4


@pytest.mark.slow
def test_mistral4_gguf_applies_the_query_temperature_the_file_holds(gguf_families):
    """A `mistral4` file with `attention.temperature_scale` and `temperature_length` (which llama.cpp's converter does
    not write today) scales queries as llama.cpp does: transformers' logits with that beta over that span."""
    from llamacpp_models import logits_of

    root, _, ids = gguf_families
    path = root / "mistral3_mistral4-f32.gguf"
    tensors, metadata = read_gguf(path)
    metadata = {**metadata, "mistral4.attention.temperature_scale": 0.1, "mistral4.attention.temperature_length": 4}
    torch_model = save_family(root / "mistral4-temperature", "mistral3_mistral4", GGUF_FAMILIES["mistral3_mistral4"][0])
    torch_model.config.text_config.rope_parameters["llama_4_scaling_beta"] = 0.1
    expected = reference_logits(torch_model, ids)
    assert relative_error(logits_of(path, tensors, metadata, ids)[0], expected) <= 1e-4
    assert relative_error(np.array(load_gguf(path, "float32")[0](mx.array(ids))), expected) > 1e-3
