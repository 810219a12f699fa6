"""Reading GGUF files with llama.cpp's own `gguf` package, because `mx.load` gets K-quants wrong.

`mx.load` decodes Q4_K tensors to wrong numbers and fails on Q5_0, Q5_1, Q2_K, Q3_K, Q5_K and the IQ
types. Here the file is memory-mapped, its header parsed, and every tensor converted from its raw blocks:

- F32, F16, BF16 (and the integer types) stay in their dtype.
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K are exactly MLX affine quantization with groups of 32
  (`w = scale * q + bias`, q unsigned), so they stay packed as `name` (uint32), `name.scales` and `name.biases`
  (".weight" dropped). Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 keep float16 scales and biases, bit for bit what `mx.load` gives;
  Q4_K/Q5_K need float32 ones, since a K-quant group's scale is a float16 super-block scale times a 6-bit integer.
- MXFP4 (gpt-oss's experts) is MLX's mxfp4: the same E2M1 values and E8M0 exponents, repacked as `name` (uint32)
  and `name.scales` (uint8), no biases.
- A file holding only types `mx.load` reads exactly (F32, F16, Q4_0, Q4_1, Q8_0) is read by `mx.load`.
- Every other type `gguf.quants` can dequantize (Q2_K, Q3_K, Q6_K, IQ*, TQ*, ...) is dequantized in float32 with
  that reference code, one tensor at a time, and then either re-packed at once into MLX affine groups of 32
  (`dequantized_dtype` None, the default: 8-bit for Q6_K, whose groups of 16 each have their own scale, 6-bit for
  the types of fewer bits), so that memory stays near the file's size, or returned as `dequantized_dtype` (float16:
  within 2^-11 relative of the reference; float32: its exact values). docs/formats.md gives the re-packing's error.
"""

import math
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

from ..errors import CheckpointError

READABLE = "F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0"  # suggested in the error for other types


# GGUF's metadata value types -> struct formats (8: string, 9: array are read by hand)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
FLOAT_TYPES = {
    T.F32: np.float32,
    T.F16: np.float16,
    T.BF16: np.uint16,
    T.F64: np.float64,
    T.I8: np.int8,
    T.I16: np.int16,
    T.I32: np.int32,
    T.I64: np.int64,
}
MX_LOAD_EXACT = {T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q8_0}  # what mx.load reads bit for bit (BF16 it rounds to float16)


class Header:
    """GGUF's header, metadata and tensor directory, parsed from a memory map in one pass.

    (`gguf.GGUFReader` reads the same, but builds a numpy view per token and merge of the vocabulary:
    seconds for a 49k-token vocabulary, against milliseconds here.)
    """

    def __init__(self, path: str | Path):
        self.data = np.memmap(path, mode="r")
        self.buffer, self.at = memoryview(self.data), 0
        magic, version = self.read("4s"), self.read("I")
        if magic != b"GGUF" or version < 2:
            raise ValueError(
                f"GGUF magic invalid or version {version} unsupported" if magic == b"GGUF" else "GGUF magic invalid"
            )
        tensor_count, field_count = self.read("Q"), self.read("Q")
        self.metadata = {self.string(): self.value(self.read("I")) for _ in range(field_count)}
        self.tensors = []  # (name, type, row-major shape, offset from the data section)
        for _ in range(tensor_count):
            name, dims = self.string(), self.read("I")
            shape = tuple(reversed([self.read("Q") for _ in range(dims)]))
            self.tensors.append((name, T(self.read("I")), shape, self.read("Q")))
        alignment = self.metadata.get("general.alignment", 32)
        self.start = (self.at + alignment - 1) // alignment * alignment

    def read(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> str:
        size = self.read("Q")
        self.at += size
        return bytes(self.buffer[self.at - size : self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.read(SCALARS[kind])
        item, count = self.read("I"), self.read("Q")
        if item in SCALARS and item != 7:  # numbers: one numpy view
            numbers = np.frombuffer(self.buffer, "<" + SCALARS[item], count, self.at)
            self.at += numbers.nbytes
            return numbers.tolist()
        return [self.value(item) for _ in range(count)]

    def raw(self, kind: T, shape: tuple, offset: int) -> np.ndarray:
        """A tensor's bytes: typed for float and integer types, (rows, bytes per row) blocks otherwise."""
        block, size = GGML_QUANT_SIZES[kind]
        begin = self.start + offset
        if kind in FLOAT_TYPES:
            return np.frombuffer(self.data, FLOAT_TYPES[kind], math.prod(shape), begin).reshape(shape)
        row_bytes = shape[-1] // block * size
        return np.frombuffer(self.data, np.uint8, math.prod(shape[:-1]) * row_bytes, begin).reshape(
            *shape[:-1], row_bytes
        )


def read_gguf(path: str | Path, dequantized_dtype: mx.Dtype | None = None) -> tuple[dict[str, mx.array], dict]:
    """Tensors (named as in the file, shapes row-major) and metadata (Python values; arrays as lists)."""
    try:
        header = Header(path)
        raw = {name: (kind, header.raw(kind, shape, offset)) for name, kind, shape, offset in header.tensors}
        if all(kind in MX_LOAD_EXACT for kind, _ in raw.values()):
            return mx.load(str(path)), header.metadata  # MLX's own reader: same values, several times faster
    except Exception as e:  # not a GGUF, truncated, corrupt: many kinds of errors, from either reader
        reason = " ".join(str(e).split()).rstrip(".") or type(e).__name__
        raise CheckpointError(f"cannot read GGUF file {path}: {reason}; re-download or re-convert it") from None
    tensors = {}
    for name, (kind, data) in raw.items():
        if kind == T.BF16:
            tensors[name] = mx.array(data).view(mx.bfloat16)
        elif data.dtype != np.uint8:  # F32, F16 and the integer types
            tensors[name] = mx.array(data)
        elif kind in PACKED:
            bits, unpack = PACKED[kind]
            q, scales, biases = unpack(data.reshape(-1, GGML_QUANT_SIZES[kind][1]))
            rows, stem = data.shape[:-1], name.removesuffix(".weight")
            tensors[name] = mx.array(pack(q.reshape(*rows, -1), bits))
            tensors[f"{stem}.scales"] = mx.array(scales.reshape(*rows, -1))
            if biases is not None:
                tensors[f"{stem}.biases"] = mx.array(biases.reshape(*rows, -1))
        else:
            try:
                w = mx.array(dequantize(data, kind))
            except NotImplementedError:
                raise CheckpointError(
                    f"cannot read tensor {name} of GGUF file {path}: type {kind.name} is not supported; "
                    f"re-quantize the model to one of {READABLE} (llama-quantize)"
                ) from None
            if dequantized_dtype is not None or w.ndim < 2 or w.shape[-1] % 32:
                tensors[name] = w.astype(dequantized_dtype or mx.float16)
                continue
            packed = mx.quantize(w, group_size=32, bits=REPACKED_BITS.get(kind, 6))
            mx.eval(packed)  # now, so that this tensor's float32 copy is freed before the next one is made
            stem = name.removesuffix(".weight")
            tensors[name], tensors[f"{stem}.scales"], tensors[f"{stem}.biases"] = packed
    return tensors, header.metadata


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of unsigned `bits`-bit values: one little-endian bit stream, first value in the lowest bits."""
    words = np.zeros((*q.shape[:-1], q.shape[-1] // 8), np.uint64)  # 8 values fill `bits` bytes exactly
    for k in range(8):
        words |= q[..., k::8].astype(np.uint64) << np.uint64(bits * k)
    return words.view(np.uint8).reshape(*words.shape, 8)[..., :bits].reshape(*q.shape[:-1], -1).view(np.uint32)


def f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at byte `at` of each block, as a (blocks, 1) column."""
    return blocks[:, at : at + 2].view(np.float16)


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


def fifth_bits(qh: np.ndarray) -> np.ndarray:
    """The 32 high bits of a block's values, stored as one little-endian word: bit j belongs to value j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def q5_0(blocks):  # w = d * (q - 16), q 5-bit
    d = f16(blocks, 0)
    return nibbles(blocks[:, 6:]) | fifth_bits(blocks[:, 2:6]) << 4, d, -16 * d


def q5_1(blocks):  # w = d * q + m, q 5-bit
    return nibbles(blocks[:, 8:]) | fifth_bits(blocks[:, 4:8]) << 4, f16(blocks, 0), f16(blocks, 2)


def q4_k(blocks):  # 8 groups of 32 per block: w = d * sc * q - dmin * m (sc, m 6-bit); products exact in float32
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = f16(blocks, 0).astype(np.float32), f16(blocks, 2).astype(np.float32)
    return nibbles(blocks[:, 16:].reshape(-1, 32)).reshape(len(blocks), -1), d * sc, -(dmin * m)


def q5_k(blocks):  # Q4_K plus a fifth bit per value: bit g of byte i of qh belongs to value i of group g
    q, scales, biases = q4_k(np.concatenate([blocks[:, :16], blocks[:, 48:]], axis=1))
    high = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # (blocks, i, g)
    return q | (high.swapaxes(1, 2).reshape(len(blocks), -1) << 4), scales, biases


def mxfp4(blocks):  # w = e2m1(q) * 2^(e - 127): MLX's mxfp4 bit for bit, the E8M0 exponent e its scale, no bias
    return nibbles(blocks[:, 1:]), blocks[:, :1], None


AFFINE = {
    T.Q8_0: (8, q8_0),
    T.Q4_0: (4, q4_0),
    T.Q4_1: (4, q4_1),
    T.Q5_0: (5, q5_0),
    T.Q5_1: (5, q5_1),
    T.Q4_K: (4, q4_k),
    T.Q5_K: (5, q5_k),
}
PACKED = {**AFFINE, T.MXFP4: (4, mxfp4)}  # kept packed: MLX affine groups of 32, or MLX mxfp4
REPACKED_BITS = {T.Q6_K: 8}  # the others re-packed, at 6 bits: at least the precision each type stores
