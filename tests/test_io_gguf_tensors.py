"""GGUF tensors as `read_gguf` returns them, type by type, against llama.cpp's reference dequantizer
(`gguf.quants.dequantize`) on the same raw blocks; metadata against `mx.load`; unreadable files."""

import re

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import write_tensors
from models import smollm2_path
from reference import require

from minimlx.errors import CheckpointError
from minimlx.io.gguf_file import read_gguf

gguf = require("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

SHAPE = (4, 512)  # a multiple of every block size
# MLX affine triples, groups of 32, float16 scales and biases: exactly the file's values, except that a K-quant's
# scale d * sc and bias -dmin * m are rounded to float16
EXACT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}
PACKED_BITS = {**EXACT_BITS, "Q4_K": 4, "Q5_K": 5}
QUANTIZABLE = ["BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]  # by gguf.quants
# The others get random blocks with sane float16 scales written at these byte offsets of each block
# (IQ1_M spreads its scale over the top nibbles of its last 8 bytes; NVFP4's 8-bit scales are always finite).
SCALES_AT = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ1_M": (),
    "NVFP4": (),
}
DEQUANTIZED = [t for t in [*QUANTIZABLE, *SCALES_AT] if t not in PACKED_BITS and t not in ("BF16", "MXFP4")]
REPACKED_BITS = {kind: 8 if kind == "Q6_K" else 6 for kind in DEQUANTIZED}  # re-packed at load, groups of 32
# the most a re-packed value may differ from the reference: one affine step of its group (half a step of rounding, and
# the float16 rounding of the scale times up to 255 levels and of the bias), and float32's rounding ...
REPACKING_STEPS = 1 + 1e-4
FLOAT16_RESOLUTION = 2**-16  # ... plus, where a scale is a float16 subnormal, its 2^-25 spacing times the levels


def random_scales(rng, n: int) -> np.ndarray:
    """Float16 scales over many binades, float16 subnormals included."""
    return (rng.uniform(0.5, 1, n) * rng.choice([-1, 1], n) * 2.0 ** rng.integers(-22, -4, n)).astype(np.float16)


def raw_tensor(kind: str, rng) -> np.ndarray:
    """Tensor data as stored in the file: float arrays, or uint8 blocks of shape (rows, bytes per row)."""
    if kind in ("F32", "F16"):
        return rng.standard_normal(SHAPE).astype(np.float32 if kind == "F32" else np.float16)
    if kind in QUANTIZABLE:
        return quantize(rng.standard_normal(SHAPE).astype(np.float32), T[kind])
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[T[kind]]
    blocks = rng.integers(0, 256, (SHAPE[0] * SHAPE[1] // block_values, block_bytes), dtype=np.uint8)
    for at in SCALES_AT[kind]:
        blocks[:, at : at + 2] = random_scales(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
    if kind == "IQ1_M":
        scale = random_scales(rng, len(blocks)).view(np.uint16)[:, None]
        packed = blocks[:, -8:].view(np.uint16)
        packed[:] = packed & 0x0FFF | ((scale >> np.arange(0, 16, 4, dtype=np.uint16)) & 0xF) << 12
    return blocks.reshape(SHAPE[0], -1)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One GGUF holding a tensor of every type, its raw data, and what read_gguf returns for it."""
    rng = np.random.default_rng(0)
    raw = {kind: raw_tensor(kind, rng) for kind in ["F32", "F16", *QUANTIZABLE, *SCALES_AT]}
    path = write_tensors(
        tmp_path_factory.mktemp("gguf") / "all_types.gguf", {f"{k}.weight": (d, k) for k, d in raw.items()}
    )
    return path, raw, read_gguf(path)[0]


def mlx_dequantized(tensors: dict, name: str) -> np.ndarray:
    """A packed triple as float32, through MLX's own dequantization."""
    stem = name.removesuffix(".weight")
    bits = tensors[name].shape[-1] // tensors[f"{stem}.scales"].shape[-1]  # 32 * bits / 32 words per group
    scales, biases = (tensors[f"{stem}.{part}"].astype(mx.float32) for part in ("scales", "biases"))
    return np.array(mx.dequantize(tensors[name], scales, biases, group_size=32, bits=bits))


def repacking_error(tensors: dict, name: str, kind: str, reference: np.ndarray) -> float:
    """A re-packed tensor's largest difference from the reference, in affine steps of its group (at most one);
    its relative error (Frobenius norm) is returned."""
    stem, bits = name.removesuffix(".weight"), REPACKED_BITS[kind]
    assert tensors[name].dtype == mx.uint32 and tensors[name].shape[-1] == reference.shape[-1] * bits // 32, name
    ours, steps = mlx_dequantized(tensors, name), np.array(tensors[f"{stem}.scales"]).astype(np.float32)
    error = np.abs(ours - reference).reshape(*steps.shape, 32) - FLOAT16_RESOLUTION
    assert (error <= REPACKING_STEPS * np.abs(steps)[..., None]).all(), name
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def assert_within_rounding(tensors: dict, name: str, reference: np.ndarray) -> None:
    """w = s * q + b with s and b rounded to float16: each value within 2^-11 of |s * q| + |b| <= |w| + 2 |b| (and of
    float16's subnormal spacing times the levels, where s is one)."""
    biases = np.repeat(np.array(tensors[f"{name.removesuffix('.weight')}.biases"].astype(mx.float32)), 32, axis=-1)
    bound = 2**-11 * (np.abs(reference) + 2 * np.abs(biases)) * (1 + 2**-10) + 2**-20
    assert (np.abs(mlx_dequantized(tensors, name) - reference) <= bound).all(), name


def assert_reads_as(tensors: dict, name: str, kind: str, reference: np.ndarray) -> None:
    """Packed and float types exactly as the reference (K-quants within their scales' float16 rounding); the re-packed
    ones within an affine step."""
    if kind in EXACT_BITS:
        np.testing.assert_array_equal(mlx_dequantized(tensors, name), reference, err_msg=name)
    elif kind in PACKED_BITS:
        assert_within_rounding(tensors, name, reference)
    elif kind in REPACKED_BITS:
        repacking_error(tensors, name, kind, reference)
    elif kind in ("F32", "F16", "BF16"):
        np.testing.assert_array_equal(np.array(tensors[name].astype(mx.float32)), reference, err_msg=name)
    else:
        raise AssertionError(f"{kind} is not read here")


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_types_keep_their_dtype(written, kind):
    _, raw, tensors = written
    assert tensors[f"{kind}.weight"].dtype == {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[kind]
    assert tensors[f"{kind}.weight"].shape == SHAPE
    assert_reads_as(tensors, f"{kind}.weight", kind, dequantize(raw[kind], T[kind]))


@pytest.mark.parametrize("kind", PACKED_BITS)
def test_packed_types_are_exact_mlx_quantization(written, kind):
    _, raw, tensors = written
    bits, name = PACKED_BITS[kind], f"{kind}.weight"
    assert tensors[name].dtype == mx.uint32 and tensors[name].shape == (SHAPE[0], SHAPE[1] * bits // 32)
    for part in (tensors[f"{kind}.scales"], tensors[f"{kind}.biases"]):
        assert part.dtype == mx.float16 and part.shape == (SHAPE[0], SHAPE[1] // 32)
    assert_reads_as(tensors, name, kind, dequantize(raw[kind], T[kind]))


@pytest.mark.parametrize("kind", DEQUANTIZED)
def test_other_types_are_repacked_into_mlx_affine(written, kind):
    _, raw, tensors = written
    reference = dequantize(raw[kind], T[kind])
    assert np.isfinite(reference).all()
    assert_reads_as(tensors, f"{kind}.weight", kind, reference)


@pytest.mark.parametrize("kind", DEQUANTIZED)
def test_other_types_read_as_float16_when_asked(written, kind):
    """dequantized_dtype float16: the reference rounded to float16 (half an ulp: 2^-11 relative, 2^-25 among float16
    subnormals)."""
    path, raw, _ = written
    w = read_gguf(path, dequantized_dtype=mx.float16)[0][f"{kind}.weight"]
    assert w.dtype == mx.float16 and w.shape == SHAPE
    reference = dequantize(raw[kind], T[kind])
    np.testing.assert_allclose(np.array(w).astype(np.float32), reference, rtol=2**-11, atol=2**-25, err_msg=kind)


def test_dequantized_dtype_float32_is_the_reference(written):
    path, raw, _ = written
    tensors = read_gguf(path, dequantized_dtype=mx.float32)[0]
    for kind in DEQUANTIZED:
        assert tensors[f"{kind}.weight"].dtype == mx.float32
        np.testing.assert_array_equal(np.array(tensors[f"{kind}.weight"]), dequantize(raw[kind], T[kind]), err_msg=kind)


def test_mxfp4_is_mlx_mxfp4(written):
    """MXFP4 stays packed as MLX's mxfp4: uint32 words, one uint8 exponent per 32 values, the reference's values."""
    _, raw, tensors = written
    w, scales = tensors["MXFP4.weight"], tensors["MXFP4.scales"]
    assert (w.dtype, w.shape, scales.dtype, scales.shape) == (mx.uint32, (4, 64), mx.uint8, (4, 16))
    unpacked = mx.dequantize(w, scales, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
    np.testing.assert_array_equal(np.array(unpacked), dequantize(raw["MXFP4"], T.MXFP4))


@pytest.mark.parametrize(
    "recipe, kinds",
    [
        ("Q4_K_M", {"F32", "Q4_K", "Q6_K"}),
        ("Q5_K_S", {"F32", "Q5_K", "Q6_K"}),
        ("Q6_K", {"F32", "Q6_K"}),
    ],
)
def test_files_llama_quantize_wrote(kquant_llama, recipe, kinds):
    """A tiny random llama quantized as llama-quantize does it (kquant_llama.py)."""
    path = kquant_llama[recipe]
    tensors, stored = read_gguf(path)[0], gguf.GGUFReader(path).tensors
    assert {tensor.tensor_type.name for tensor in stored} == kinds
    for tensor in stored:
        assert_reads_as(tensors, tensor.name, tensor.tensor_type.name, dequantize(tensor.data, tensor.tensor_type))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_stacked_experts_keep_their_leading_dimensions(tmp_path, kind):
    data = raw_tensor(kind, np.random.default_rng(1)).reshape(2, 2, -1)  # (experts, rows, bytes per row)
    tensors = read_gguf(write_tensors(tmp_path / "experts.gguf", {"experts.weight": (data, kind)}))[0]
    assert tensors["experts.weight"].shape[:2] == (2, 2)
    assert_reads_as(tensors, "experts.weight", kind, dequantize(data, T[kind]))


def test_mx_load_types_are_bit_identical_to_mx_load(written, tmp_path):
    _, raw, _ = written
    kinds = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]  # what mx.load reads right (BF16 it turns into float16)
    path = write_tensors(tmp_path / "mx_load_types.gguf", {f"{kind}.weight": (raw[kind], kind) for kind in kinds})
    theirs = mx.load(str(path))
    ours = read_gguf(path)[0]
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        assert np.array_equal(np.array(ours[name]).view(np.uint8), np.array(theirs[name]).view(np.uint8)), name


@pytest.mark.slow
def test_metadata_matches_mx_load():
    """Same keys and values as `mx.load` after `.item()` on its scalars. Numeric arrays (token types, scores)
    are lists here, mx.arrays there: the tokenizer reads both through `list`/`tolist`."""
    path = smollm2_path()
    ours = read_gguf(path)[1]
    _, theirs = mx.load(str(path), return_metadata=True)
    theirs = {k: (v.item() if v.ndim == 0 else v.tolist()) if isinstance(v, mx.array) else v for k, v in theirs.items()}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == value and type(ours[key]) is type(value), key
    assert isinstance(ours["tokenizer.ggml.tokens"], list) and isinstance(ours["tokenizer.ggml.token_type"], list)


def test_unreadable_tensor_type(tmp_path):
    path = write_tensors(tmp_path / "q8_k.gguf", {"blk.0.attn_q.weight": (np.zeros((2, 292), np.uint8), "Q8_K")})
    with pytest.raises(CheckpointError) as error:
        read_gguf(path)
    assert str(error.value) == (
        f"cannot read tensor blk.0.attn_q.weight of GGUF file {path}: type Q8_K is not supported; "
        "re-quantize the model to one of F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0 (llama-quantize)"
    )


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda data: b"not a GGUF file at all", "GGUF magic invalid"),
        (lambda data: data[: len(data) - 100], ".+"),  # truncated, empty: numpy's words for it
        (lambda data: b"", ".+"),
    ],
)
def test_corrupt_file(written, tmp_path, damage, reason):
    path = tmp_path / "broken.gguf"
    path.write_bytes(damage(written[0].read_bytes()))
    with pytest.raises(CheckpointError) as error:
        read_gguf(path)
    assert re.fullmatch(
        f"cannot read GGUF file {re.escape(str(path))}: {reason}; re-download or re-convert it", str(error.value)
    )
