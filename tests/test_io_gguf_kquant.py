"""Q4_K_M, Q5_K_S and Q6_K files of gemma2, gemma3, phi3, glm4, gpt-oss, deepseek (MoE 16B style) and smollm3, made
from F32 files of llama.cpp's converter as llama-quantize makes them (tests/gguf_quantize.py; the last test proves
the files equal llama-quantize's where a llama-quantize binary is at hand).

The models are test_io_gguf_llamacpp.py's, made wide enough for the K-quants to apply (hidden 256, 16 heads of 16: rows
of whole blocks of 256); gemma2's and glm4's ffn_down rows of 384 fall back to Q5_0/Q5_1/Q8_0, as in many published
files. deepseek and smollm3 get a tiny SentencePiece vocabulary (their converters take one), the others the one
test_io_gguf_llamacpp.py gives them. Each file's logits, minimlx reading it in float32, must be within 1e-4 (the
acceptance asks 5e-3; `relative_error`: the norm of the difference over the reference's norm, as in
test_io_gguf_llamacpp.py) of transformers reading the same file where it reads the architecture, and otherwise of the
file's tensors dequantized by gguf-py, llama.cpp's reference code.
"""

import functools
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import load_gguf
from gguf_quantize import FTYPES, quantize
from llamacpp import Reader, llama_quantize
from llamacpp_models import IDS, MODELS, SENTENCEPIECE, SP_VOCAB, convert_models, logits_of
from reference import reference_logits, relative_error, require

from minimlx.io.gguf_file import GGUFFile

FAMILIES = ("gemma2", "gemma3", "phi3", "glm4", "gpt_oss", "deepseek", "smollm3")
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=16)
WIDER = {  # beyond WIDE, per family
    "gemma2": dict(intermediate_size=384),
    "glm4": dict(intermediate_size=384),
    "deepseek": dict(moe_intermediate_size=256, vocab_size=SP_VOCAB),
    "smollm3": dict(vocab_size=SP_VOCAB),
}
KQUANT_MODELS = {
    name: (config_class, {**config, **WIDE, **WIDER.get(name, {})}, *rest)
    for name, (config_class, config, *rest) in MODELS.items()
    if name in FAMILIES
}
KQUANT_SENTENCEPIECE = {**SENTENCEPIECE, "deepseek": (True, ()), "smollm3": (True, ())}
read = functools.cache(Reader)  # each file's vocabulary parsed once


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The folder of the K-quant models' F32 files, root / f"{name}-f32.gguf"."""
    root = tmp_path_factory.mktemp("kquant")
    convert_models(root, KQUANT_MODELS, KQUANT_SENTENCEPIECE, ("f32",))
    return root


@functools.cache
def quantized(root: Path, name: str, ftype: str) -> Path:
    path = root / f"{name}-{ftype}.gguf"
    quantize(read(root / f"{name}-f32.gguf"), path, ftype)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("ftype", FTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_k_quant_file_matches_its_reference(wide, name, ftype):
    torch, transformers, gguf = require("torch"), require("transformers"), require("gguf")
    path, kwargs = quantized(wide, name, ftype), KQUANT_MODELS[name][-1]
    assert FTYPES[ftype][1] in {t.tensor_type for t in read(path).tensors}
    ids = IDS % KQUANT_MODELS[name][1]["vocab_size"]
    model, _ = load_gguf(path, "float32")
    logits = np.array(model(mx.array(ids)))
    if kwargs is not None:
        require("accelerate")
        with pytest.MonkeyPatch.context() as patch:  # the file as read above
            patch.setattr(gguf, "GGUFReader", read)
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs
            )
        expected = reference_logits(reference, ids)
    else:
        from gguf.quants import dequantize

        tensors = {t.name: mx.array(dequantize(t.data, t.tensor_type)) for t in read(path).tensors}
        expected = logits_of(path, tensors, GGUFFile(path).metadata, ids)[0]
    assert relative_error(logits, expected) <= 1e-4


# llama-quantize cannot read a deepseek2 file without query compression (it asks for q_lora_rank)
EQUALLED = [name for name in MODELS if name != "deepseek_v2_lite"]


@pytest.mark.slow  # runs llama.cpp's llama-quantize over every family
@pytest.mark.parametrize("ftype", FTYPES)
def test_files_equal_llama_quantize(request, ftype, tmp_path):
    """The files are llama-quantize's, byte for byte: for the seven families' wide models, for the F32 files of
    test_io_gguf_llamacpp.py's models of every family, whose rows of 64 and 96 make every K-quant fall back, and for
    kquant_llama.py's llama. llama-quantize is $MINIMLX_LLAMA_QUANTIZE or built into the test cache (tests/llamacpp.py's
    `llamacpp_tool`; .ci/run builds it before the tests)."""
    quantize_tool = llama_quantize()
    wide, narrow = request.getfixturevalue("wide"), request.getfixturevalue("converted")
    sources = [wide / f"{name}-f32.gguf" for name in FAMILIES] + [narrow / f"{name}-f32.gguf" for name in EQUALLED]
    sources.append(request.getfixturevalue("kquant_llama")["F32"])
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    for source in sources:
        quantize(read(source), ours, ftype)
        subprocess.run([quantize_tool, "--allow-requantize", source, theirs, ftype], check=True, capture_output=True)
        assert ours.read_bytes() == theirs.read_bytes(), f"{source.name}: {difference(ours, theirs)}"


def difference(ours: Path, theirs: Path) -> str:
    """The first tensor whose name, type or bytes differ between two GGUF files; else, their metadata differs."""
    for a, b in zip(Reader(ours).tensors, Reader(theirs).tensors):
        if (a.name, a.tensor_type) != (b.name, b.tensor_type) or not np.array_equal(a.data, b.data):
            return f"{a.name} ({a.tensor_type.name}) against {b.name} ({b.tensor_type.name})"
    return "the metadata or the number of tensors"
