"""Reading GGUF files with llama.cpp's own `gguf` package, because `mx.load` gets K-quants wrong.

`mx.load` decodes Q4_K tensors to wrong numbers and fails on Q5_0, Q5_1, Q2_K, Q3_K, Q5_K and the IQ
types. Here `gguf.GGUFReader` memory-maps the file and every tensor is converted from its raw blocks:

- F32, F16, BF16 (and the integer types) stay in their dtype.
- Q4_0, Q4_1, Q8_0, Q4_K and Q5_K are exactly MLX affine quantization with groups of 32 (`w = scale * q + bias`,
  q unsigned), so they stay packed as `name` (uint32), `name.scales` and `name.biases` (".weight" dropped).
  Q4_0/Q4_1/Q8_0 keep float16 scales and biases, bit for bit what `mx.load` gives; Q4_K/Q5_K need float32 ones,
  since a K-quant group's scale is a float16 super-block scale times a 6-bit integer.
- Every other type `gguf.quants` can dequantize (Q5_0, Q5_1, Q2_K, Q3_K, Q6_K, IQ*, TQ*, MXFP4, ...) is
  dequantized in float32 with that reference code, one tensor at a time, and returned as `dequantized_dtype`:
  float16 by default (half the memory; within 2^-11 relative of the reference), float32 for exact values.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

from ..errors import CheckpointError

READABLE = "F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0"  # suggested in the error for other types


class Reader(GGUFReader):
    """`GGUFReader` over a plain ndarray view of its memory map: the same bytes, without `np.memmap`'s cost on
    each of the reader's slices (one per token and merge: 3x faster on SmolLM2's 49k-token vocabulary)."""

    data = property(lambda self: self._data, lambda self, memmap: setattr(self, "_data", memmap.view(np.ndarray)))


def read_gguf(path: str | Path, dequantized_dtype: mx.Dtype = mx.float16) -> tuple[dict[str, mx.array], dict]:
    """Tensors (named as in the file, shapes row-major) and metadata (Python values; arrays as lists)."""
    try:
        reader = Reader(path)
    except Exception as e:  # not a GGUF, truncated, corrupt: the reader raises many kinds of errors
        reason = " ".join(str(e).split()).rstrip(".")
        raise CheckpointError(f"cannot read GGUF file {path}: {reason}; re-download or re-convert it") from None
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    for tensor in reader.tensors:
        kind, data, name = tensor.tensor_type, tensor.data, tensor.name
        if kind == T.BF16:
            tensors[name] = mx.array(data.view(np.uint16)).view(mx.bfloat16)
        elif data.dtype != np.uint8:  # F32, F16 and the integer types: the reader already typed them
            tensors[name] = mx.array(data)
        elif kind in AFFINE:
            bits, unpack = AFFINE[kind]
            q, scales, biases = unpack(data.reshape(-1, GGML_QUANT_SIZES[kind][1]))
            rows, stem = data.shape[:-1], name.removesuffix(".weight")
            tensors[name] = mx.array(pack(q.reshape(*rows, -1), bits))
            tensors[f"{stem}.scales"] = mx.array(scales.reshape(*rows, -1))
            tensors[f"{stem}.biases"] = mx.array(biases.reshape(*rows, -1))
        else:
            try:
                tensors[name] = mx.array(dequantize(data, kind)).astype(dequantized_dtype)
            except NotImplementedError:
                raise CheckpointError(
                    f"cannot read tensor {name} of GGUF file {path}: type {kind.name} is not supported; "
                    f"re-quantize the model to one of {READABLE} (llama-quantize)"
                ) from None
    return tensors, metadata


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of unsigned `bits`-bit values: one little-endian bit stream, first value in the lowest bits."""
    words = np.zeros((*q.shape[:-1], q.shape[-1] // 8), np.uint64)  # 8 values fill `bits` bytes exactly
    for k in range(8):
        words |= q[..., k::8].astype(np.uint64) << np.uint64(bits * k)
    return words.view(np.uint8).reshape(*words.shape, 8)[..., :bits].reshape(*q.shape[:-1], -1).view(np.uint32)


def f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at byte `at` of each block, as a (blocks, 1) column."""
    return blocks[:, at:at + 2].view(np.float16)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """4-bit values stored in runs of bytes: each run's low nibbles, then its high nibbles."""
    return np.stack([qs & 15, qs >> 4], axis=-2).reshape(qs.shape[0], -1)


# Each unpacks raw blocks (one per row) into unsigned values q, and scales and biases per group of 32.
def q8_0(blocks):  # w = d * q, q int8: d * (q + 128) - 128 d
    d = f16(blocks, 0)
    return blocks[:, 2:] ^ np.uint8(0x80), d, -128 * d


def q4_0(blocks):  # w = d * (q - 8)
    d = f16(blocks, 0)
    return nibbles(blocks[:, 2:]), d, -8 * d


def q4_1(blocks):  # w = d * q + m
    return nibbles(blocks[:, 4:]), f16(blocks, 0), f16(blocks, 2)


def q4_k(blocks):  # 8 groups of 32 per block: w = d * sc * q - dmin * m (sc, m 6-bit); products exact in float32
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = f16(blocks, 0).astype(np.float32), f16(blocks, 2).astype(np.float32)
    return nibbles(blocks[:, 16:].reshape(-1, 32)).reshape(len(blocks), -1), d * sc, -(dmin * m)


def q5_k(blocks):  # Q4_K plus a fifth bit per value: bit g of byte i of qh belongs to value i of group g
    q, scales, biases = q4_k(np.concatenate([blocks[:, :16], blocks[:, 48:]], axis=1))
    high = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # (blocks, i, g)
    return q | (high.swapaxes(1, 2).reshape(len(blocks), -1) << 4), scales, biases


AFFINE = {T.Q8_0: (8, q8_0), T.Q4_0: (4, q4_0), T.Q4_1: (4, q4_1), T.Q4_K: (4, q4_k), T.Q5_K: (5, q5_k)}
