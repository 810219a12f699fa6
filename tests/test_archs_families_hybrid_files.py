"""The hybrid families from the files other tools write of them: mlx-lm's own `convert` (float32, and 4-bit) of LFM2
and Granite 4, and llama.cpp's converter (f32 and q8_0) of LFM2, Granite 4, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE.

mlx-lm folders: minimlx gives mlx-lm's own logits on the same folder (float32: within 1e-5; 4-bit, kept packed: the
same greedy ids), and transformers' for the float32 one. mlx-lm's Granite 4 normalises the Mamba2 layers' gated
output over all their heads at once, transformers' (and minimlx's, and llama.cpp's) one group of heads at a time:
the same numbers for the published checkpoints' single group, which the folders here have.

GGUF files: the f32 file gives transformers' logits of the source model; the q8_0 one those of its tensors as gguf-py,
llama.cpp's reference code, dequantizes them. llama.cpp's converter writes Granite 4 without RoPE whenever it has
Mamba2 layers (as the published checkpoints are), and a dense Granite 4's FFN width as `intermediate_size` (which
the published dense checkpoints set to their `shared_intermediate_size`): the source models here are so.

llama-quantize's Q4_K_M files of them (tiny rows falling back to Q5_0 and Q8_0, and a Qwen3.5 wide enough for Q4_K
and Q6_K rows) give the logits of gguf-py's dequantization, their linear maps kept packed as the file stores them.
`minimlx convert` writes each family from the Hugging Face folder, mlx-lm's folders and the GGUF files into MLX
folders mlx-lm reads.
"""

import json
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf_files import load_gguf, reference_tensors
from hybrid_model import FAMILIES, GRANITE, QWEN3_5_SIZES
from mlx_lm_reference import mlx_lm_convert, mlx_lm_logits, save_tokenizer
from reference import random_ids, reference_logits, relative_error, save_reference, to_v4_layout

import minimlx
from minimlx.cpu.linear import BlockWeight, NativeBlockLinear
from minimlx.io.gguf_file import read_gguf

TOKENS = 80  # over one 64-token chunk of the delta rule

# A dense Granite 4 as published: its FFN's width also as intermediate_size (mlx-lm's and llama.cpp's key for it).
DENSE_GRANITE = dict(GRANITE, intermediate_size=GRANITE["shared_intermediate_size"])
# name -> (transformers config class, config as published: LFM2 tied, with block_dim; Granite 4 with one group)
MLX_LM = {
    "lfm2": ("Lfm2Config", dict(FAMILIES["lfm2"][1], block_dim=64, tie_word_embeddings=True)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(DENSE_GRANITE, mamba_n_groups=1)),
    "granitemoehybrid_moe": ("GraniteMoeHybridConfig", dict(FAMILIES["granitemoehybrid_moe"][1], mamba_n_groups=1)),
}
MLX_LM_VARIANTS = {"float32": dict(dtype="float32"), "4bit": dict(quantize=True, q_bits=4, q_group_size=32)}


@pytest.fixture(scope="module", params=sorted(MLX_LM))
def mlx_lm_folders(request, tmp_path_factory):
    """({variant: mlx-lm's folder}, transformers' logits, ids) of one family, converted once."""
    config_class, config = MLX_LM[request.param]
    source = tmp_path_factory.mktemp(f"hf-{request.param}")
    torch_model = save_reference(source, config_class, **config)
    to_v4_layout(source)
    save_tokenizer(source)
    root = tmp_path_factory.mktemp(f"mlx-{request.param}")
    folders = {variant: mlx_lm_convert(source, root / variant, **o) for variant, o in MLX_LM_VARIANTS.items()}
    ids = random_ids(config["vocab_size"], tokens=TOKENS)
    return dict(folders, source=source), reference_logits(torch_model, ids), ids


@pytest.mark.slow
def test_mlx_lm_float32_folder_matches_mlx_lm_and_transformers(mlx_lm_folders):
    folders, reference, ids = mlx_lm_folders
    model = minimlx.load_model(folders["float32"], dtype="float32")
    logits = np.array(model(mx.array(ids)))
    assert relative_error(logits, np.array(mlx_lm_logits(folders["float32"], ids))) <= 1e-5
    assert relative_error(logits, reference) <= 1e-4


@pytest.mark.slow
def test_mlx_lm_4bit_folder_matches_mlx_lm(mlx_lm_folders):
    folders, _, ids = mlx_lm_folders
    expected = np.array(mlx_lm_logits(folders["4bit"], ids))
    model = minimlx.load_model(folders["4bit"], dtype="quantized")
    logits = np.array(model(mx.array(ids)).astype(mx.float32))
    assert np.array_equal(logits.argmax(-1), expected.argmax(-1))
    assert relative_error(logits, expected) <= 1e-4


@pytest.mark.slow
def test_minimlx_convert_writes_folders_mlx_lm_reads(mlx_lm_folders, tmp_path):
    """`minimlx convert` of the Hugging Face folder (float32, and 4-bit) and of mlx-lm's 4-bit folder (kept packed):
    mlx-lm reads each with minimlx's logits, transformers' for the float32 one and its own for the kept one (a
    mixture's routers stay in float where mlx-lm's convert packs them in 8 bits, so its 4-bit differs there)."""
    folders, reference, ids = mlx_lm_folders
    written = minimlx.convert(folders["source"], tmp_path / "float32")
    assert relative_error(np.array(mlx_lm_logits(written, ids)), reference) <= 1e-4
    for source, options in ((folders["source"], dict(bits=4, group_size=32)), (folders["4bit"], {})):
        packed = minimlx.convert(source, tmp_path / f"4bit-{len(options)}", **options)
        theirs = np.array(mlx_lm_logits(packed, ids))
        ours = np.array(minimlx.load_model(packed, dtype="float32")(mx.array(ids)))
        assert relative_error(ours, theirs) <= 1e-4
    assert relative_error(theirs, np.array(mlx_lm_logits(folders["4bit"], ids))) <= 1e-6


GGUF_VOCAB = 49152  # SmolLM2's tokenizer, one llama.cpp's converter recognises
# name (llama.cpp's architecture) -> (transformers config class, config); qwen35: the `hybrid` fixture's model
INTERVAL = ["linear_attention"] * 3 + ["full_attention"]  # as published Qwen3-Next configs give it (no layer_types)
GGUF_SIZES = dict(vocab_size=GGUF_VOCAB, tie_word_embeddings=True)  # the head tied: the vocabulary is most of a file
GGUF = {
    "lfm2": ("Lfm2Config", dict(FAMILIES["lfm2"][1], **GGUF_SIZES)),
    "granitehybrid": (  # no experts chosen either, as published (llama.cpp's loader refuses more than it has)
        "GraniteMoeHybridConfig",
        dict(DENSE_GRANITE, position_embedding_type="nope", num_experts_per_tok=0, **GGUF_SIZES),
    ),
    "qwen3next": ("Qwen3NextConfig", dict(FAMILIES["qwen3_next"][1], layer_types=INTERVAL, **GGUF_SIZES)),
    "qwen35moe": ("Qwen3_5MoeTextConfig", dict(FAMILIES["qwen3_5_moe_text"][1], **GGUF_SIZES)),
    "qwen35": None,
}


# A Qwen3.5 wide enough for the K-quants (rows of whole blocks of 256) in every linear map, the DeltaNet's among them;
# as many value heads as key heads, as Qwen3.5-0.8B has. Only its K-quant file is tested.
WIDE = "qwen35-wide"
WIDE_QWEN3_5 = dict(
    QWEN3_5_SIZES,
    **GGUF_SIZES,
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    linear_num_key_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    layer_types=INTERVAL,
)


@pytest.fixture(scope="module")
def gguf_files(hybrid, tmp_path_factory):
    """(root, {name: transformers' logits}, ids): each family saved with SmolLM2's tokenizer (Qwen3.5: the `hybrid`
    fixture's folder) and converted once, to f32 and q8_0, by one converter process."""
    from llamacpp import convert
    from llamacpp_models import converter_inputs

    sources, tokenizer = converter_inputs()
    root = tmp_path_factory.mktemp("gguf-hybrid")
    ids = random_ids(GGUF_VOCAB, batch=1, tokens=TOKENS)
    references, jobs = {}, []
    for name, source in GGUF.items():
        if source is None:
            folder, model, _, _ = hybrid
        else:
            folder, (config_class, config) = root / name, source
            model = save_reference(folder, config_class, **config)
            to_v4_layout(folder)  # as published: layer kinds as llama.cpp's converter reads them
            shutil.copytree(tokenizer, folder, dirs_exist_ok=True)
        references[name] = reference_logits(model, ids)
        flags = ["--no-mtp"] if name.startswith("qwen") else []  # Qwen's multi-token-prediction layer left out
        jobs += [(folder, kind, root / f"{name}-{kind}.gguf", flags) for kind in ("f32", "q8_0")]
    folder = root / WIDE
    save_reference(folder, "Qwen3_5TextConfig", **WIDE_QWEN3_5)
    shutil.copytree(tokenizer, folder, dirs_exist_ok=True)
    jobs.append((folder, "f32", root / f"{WIDE}-f32.gguf", ["--no-mtp"]))
    convert(jobs, sources)
    return root, references, ids


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GGUF))
def test_f32_gguf_matches_the_source_model(gguf_files, name):
    root, references, ids = gguf_files
    model, metadata = load_gguf(root / f"{name}-f32.gguf", "float32")
    assert metadata["general.architecture"] == name
    assert relative_error(np.array(model(mx.array(ids))), references[name]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GGUF))
def test_q8_0_gguf_matches_its_reference_dequantization(gguf_files, name):
    """The q8_0 file gives the logits of its tensors as gguf-py dequantizes them: the same numbers read as float32
    (Qwen3.5's DeltaNet out_proj too, whose columns are re-ordered: unpacked in float32), and kept packed."""
    from llamacpp_models import logits_of

    root, _, ids = gguf_files
    path = root / f"{name}-q8_0.gguf"
    tensors, metadata = read_gguf(path, mx.float32)
    assert any(key.endswith(".scales") for key in tensors)
    expected = logits_of(path, reference_tensors(path), metadata, ids)[0]
    assert np.array_equal(logits_of(path, tensors, metadata, ids)[0], expected)
    packed, _ = load_gguf(path, "quantized")
    assert relative_error(np.array(packed(mx.array(ids)).astype(mx.float32)), expected) <= 1e-4


@pytest.mark.slow
def test_qwen3next_file_without_recurrent_layers_attends_every_interval(gguf_files):
    """A file that names no recurrent layers (an older converter's) attends in every `full_attention_interval`-th
    layer, as llama.cpp reads it."""
    from llamacpp_models import logits_of

    root, references, ids = gguf_files
    path = root / "qwen3next-f32.gguf"
    tensors, metadata = read_gguf(path)
    del metadata["qwen3next.attention.recurrent_layers"]
    assert relative_error(logits_of(path, tensors, metadata, ids)[0], references["qwen3next"]) <= 1e-4


# The files mlx-lm reads as transformers does: not Qwen3.5's (mlx-lm takes every fourth layer as attending, which
# their layer kinds are not) nor Granite 4's (two groups of heads, which mlx-lm's gated norm does not keep apart).
MLX_LM_READS = ("lfm2", "qwen3next")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GGUF))
def test_gguf_converts_to_mlx_folders(gguf_files, name, tmp_path):
    """`minimlx convert` of the f32 file gives transformers' logits in minimlx and (`MLX_LM_READS`) in mlx-lm."""
    root, references, ids = gguf_files
    folder = minimlx.convert(root / f"{name}-f32.gguf", tmp_path / "f32")
    assert (
        relative_error(np.array(minimlx.load_model(folder, dtype="float32")(mx.array(ids))), references[name]) <= 1e-4
    )
    if name in MLX_LM_READS:
        assert relative_error(np.array(mlx_lm_logits(folder, ids)), references[name]) <= 1e-4


@pytest.mark.slow
def test_packed_gguf_converts_to_a_packed_mlx_folder(gguf_files, tmp_path):
    """Qwen3.5's q8_0 file (its DeltaNet's rows re-ordered from llama.cpp's tiled heads while packed), kept packed in
    the folder: the file's own logits."""
    root, _, ids = gguf_files
    path = root / "qwen35-q8_0.gguf"
    packed, _ = load_gguf(path, "quantized")
    expected = np.array(packed(mx.array(ids)).astype(mx.float32))
    folder = minimlx.convert(path, tmp_path / "q8_0")
    assert "quantization" in json.loads((folder / "config.json").read_text())
    ours = np.array(minimlx.load_model(folder, dtype="quantized")(mx.array(ids)).astype(mx.float32))
    assert relative_error(ours, expected) <= 1e-4


@pytest.fixture(scope="module")
def q4_k_m_files(gguf_files):
    """The f32 files quantized by llama.cpp's llama-quantize to Q4_K_M: their rows of 64 fall back to Q5_0, Q8_0 and
    the like, as many tensors of small published models do."""
    from llamacpp import llama_quantize

    tool = llama_quantize()
    root = gguf_files[0]
    for name in [*GGUF, WIDE]:
        source, target = root / f"{name}-f32.gguf", root / f"{name}-q4_k_m.gguf"
        subprocess.run([tool, source, target, "Q4_K_M"], check=True, capture_output=True)
    return gguf_files


TILED = {"lfm2": False, "granitehybrid": False, "qwen3next": False, "qwen35moe": True, "qwen35": True, WIDE: False}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(GGUF), WIDE])
def test_q4_k_m_gguf_matches_its_reference_dequantization(q4_k_m_files, name):
    """llama-quantize's Q4_K_M file gives the logits of its tensors as gguf-py dequantizes them, its linear maps kept
    packed, the recurrent layers' as the attention layers'."""
    from llamacpp_models import logits_of

    root, _, ids = q4_k_m_files
    path = root / f"{name}-q4_k_m.gguf"
    tensors, metadata = read_gguf(path, mx.float32)
    expected = logits_of(path, reference_tensors(path), metadata, ids)[0]
    model, _ = load_gguf(path, "quantized")
    assert relative_error(np.array(model(mx.array(ids)).astype(mx.float32)), expected) <= 1e-4
    maps = {p: m for p, m in model.named_modules() if "_proj" in p.rsplit(".", 1)[-1] and ".experts." not in p}
    packed = (nn.QuantizedLinear, BlockWeight)
    # in float: the rows llama-quantize keeps so (not whole blocks of 32), and Qwen3.5's DeltaNet out_proj, whose
    # columns come in llama.cpp's tiled head order, not whole groups
    unpacked = {p for p, m in maps.items() if not isinstance(m, packed) and m.weight.shape[1] % 32 == 0}
    assert unpacked == ({p for p in maps if p.endswith("out_proj") and ".attn." in p} if TILED[name] else set())
    if name == WIDE:  # the K-quant rows as stored, through the native block products, in every layer
        kinds = {p.rsplit(".", 1)[-1]: m.mode for p, m in maps.items() if isinstance(m, NativeBlockLinear)}
        deltanet = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
        assert deltanet | {"q_proj", "o_proj"} <= set(kinds) and set(kinds.values()) <= {"q4_k", "q5_k", "q6_k"}
