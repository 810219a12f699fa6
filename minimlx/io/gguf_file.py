"""Reading GGUF files with llama.cpp's own `gguf` package, because `mx.load` gets K-quants wrong.

`mx.load` decodes Q4_K tensors to wrong numbers and fails on Q5_0, Q5_1, Q2_K, Q3_K, Q5_K and the IQ
types (and copies the whole file into memory while its memory map is resident). Here the header is parsed in one
pass and each tensor is read on its own, straight from the file into the arrays that hold it (rows of blocks a
chunk at a time), so reading holds the converted tensors plus one chunk, and no page of the file stays mapped:

- F32, F16, BF16 (and the integer types) stay in their dtype.
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K are exactly MLX affine quantization with groups of 32
  (`w = scale * q + bias`, q unsigned), so they stay packed as `name` (uint32), `name.scales` and `name.biases`
  (".weight" dropped), with float16 scales and biases. Q4_0/Q4_1/Q5_0/Q5_1/Q8_0's are bit for bit what `mx.load`
  gives; a K-quant group's scale is a float16 super-block scale times a 6-bit integer, rounded to float16 here
  (2^-11 relative at most: docs/formats.md gives the measured error), unless a float `dequantized_dtype` is asked
  for: then Q4_K and Q5_K are dequantized as the types below are, exactly.
- Where the caller asks for them `stored` (the native CPU kernel, which multiplies them as they are:
  quantization.BLOCK_MODES), Q4_K, Q5_K, Q6_K and Q8_0 matrices stay as the file stores them: `name` holds each
  row's blocks as uint8, (rows, row bytes), and nothing else, so memory is the file's bytes.
- MXFP4 (gpt-oss's experts) is MLX's mxfp4: the same E2M1 values and E8M0 exponents, repacked as `name` (uint32)
  and `name.scales` (uint8), no biases.
- Every other type `gguf.quants` can dequantize (Q2_K, Q3_K, Q6_K, IQ*, TQ*, ...) is dequantized in float32 with
  that reference code, a chunk of rows at a time, and then either re-packed into MLX affine groups of 32 with
  float16 scales and biases (`dequantized_dtype` None, the default: 8-bit for Q6_K, whose groups of 16 each have
  their own scale, 6-bit for the types of fewer bits), so that memory stays near the file's size, or returned as
  `dequantized_dtype` (float16: within 2^-11 relative of the reference; float32: its exact values).
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
CHUNK_VALUES = 1 << 20  # values converted at a time: a few MB of temporaries, however large the tensor


# GGUF's metadata value types -> struct formats (8: string, 9: array are read by hand)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
FLOAT_TYPES = {
    T.F32: mx.float32,
    T.F16: mx.float16,
    T.BF16: mx.bfloat16,
    T.F64: mx.float64,
    T.I8: mx.int8,
    T.I16: mx.int16,
    T.I32: mx.int32,
    T.I64: mx.int64,
}


class GGUFFile:
    """GGUF's header, metadata and tensor directory, parsed in one pass; `read` reads one tensor.

    (`gguf.GGUFReader` parses the same, but builds a numpy view per token and merge of the vocabulary:
    seconds for a 49k-token vocabulary, against milliseconds here.)
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        data = np.memmap(path, mode="r")
        self.buffer, self.at = memoryview(data), 0
        try:
            magic, version = self.read_value("4s"), self.read_value("I")
            if magic != b"GGUF" or version < 2:
                raise ValueError(
                    f"GGUF magic invalid or version {version} unsupported" if magic == b"GGUF" else "GGUF magic invalid"
                )
            tensor_count, field_count = self.read_value("Q"), self.read_value("Q")
            self.metadata = {self.string(): self.value(self.read_value("I")) for _ in range(field_count)}
            self.tensors = {}  # name -> (type, row-major shape, offset from the data section)
            for _ in range(tensor_count):
                name, dims = self.string(), self.read_value("I")
                shape = tuple(reversed([self.read_value("Q") for _ in range(dims)]))
                self.tensors[name] = (T(self.read_value("I")), shape, self.read_value("Q"))
        finally:
            self.buffer.release()  # the metadata is copied out: no page of the file stays mapped
        alignment = self.metadata.get("general.alignment", 32)
        self.start = (self.at + alignment - 1) // alignment * alignment
        for name, (kind, shape, offset) in self.tensors.items():
            if self.start + offset + nbytes(kind, shape) > len(data):
                raise ValueError(f"tensor {name} runs past the end of the file")

    def read_value(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> str:
        size = self.read_value("Q")
        self.at += size
        return bytes(self.buffer[self.at - size : self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.read_value(SCALARS[kind])
        item, count = self.read_value("I"), self.read_value("Q")
        if item in SCALARS and item != 7:  # numbers: one numpy view
            numbers = np.frombuffer(self.buffer, "<" + SCALARS[item], count, self.at)
            self.at += numbers.nbytes
            return numbers.tolist()
        return [self.value(item) for _ in range(count)]

    def layout(
        self, name: str, dequantized_dtype: mx.Dtype | None = None, stored: frozenset = frozenset()
    ) -> dict[str, tuple[tuple, mx.Dtype]]:
        """The arrays `read` gives for tensor `name`: names -> (shape, dtype). Matrices of the types in `stored` are
        kept as stored (their blocks' bytes a row)."""
        kind, shape, _ = self.tensors[name]
        if kind in FLOAT_TYPES:
            return {name: (shape, FLOAT_TYPES[kind])}
        if kind in stored and dequantized_dtype is None and len(shape) in (2, 3):  # a matrix, or stacked experts'
            return {name: ((*shape[:-1], nbytes(kind, shape[-1:])), mx.uint8)}
        stem, rows, columns = name.removesuffix(".weight"), shape[:-1], shape[-1]
        if kind == T.MXFP4:
            return {name: ((*rows, columns // 8), mx.uint32), f"{stem}.scales": ((*rows, columns // 32), mx.uint8)}
        if kind in AFFINE and not (dequantized_dtype is not None and kind in ROUNDED):
            bits = AFFINE[kind][0]
        elif not dequantizable(kind):
            raise CheckpointError(
                f"cannot read tensor {name} of GGUF file {self.path}: type {kind.name} is not supported; "
                f"re-quantize the model to one of {READABLE} (llama-quantize)"
            )
        elif dequantized_dtype is not None or not rows or columns % 32:
            return {name: (shape, dequantized_dtype or mx.float16)}
        else:
            bits = REPACKED_BITS.get(kind, 6)
        groups = ((*rows, columns // 32), mx.float16)
        return {name: ((*rows, columns * bits // 32), mx.uint32), f"{stem}.scales": groups, f"{stem}.biases": groups}

    def read(
        self, name: str, dequantized_dtype: mx.Dtype | None = None, stored: frozenset = frozenset()
    ) -> dict[str, mx.array]:
        """Tensor `name` as the arrays `layout` names, read from the file a chunk of rows at a time into them."""
        kind, shape, offset = self.tensors[name]
        layout = self.layout(name, dequantized_dtype, stored)
        held = {
            part: mx.zeros(size, mx.uint16 if dtype == mx.bfloat16 else dtype) for part, (size, dtype) in layout.items()
        }
        mx.eval(held)
        views = [np.array(a, copy=False) for a in held.values()]  # writing into these fills the arrays
        with open(self.path, "rb", buffering=0) as file:
            if kind in FLOAT_TYPES or layout[name][1] == mx.uint8:  # floats, or blocks kept as stored
                read_at(file, self.start + offset, views[0])
            else:
                block, size = GGML_QUANT_SIZES[kind]
                row_bytes, rows = shape[-1] // block * size, math.prod(shape[:-1])
                views = [view.reshape(rows, -1) for view in views]
                step = max(1, CHUNK_VALUES // shape[-1])
                for first in range(0, rows, step):
                    blocks = np.empty((min(step, rows - first), row_bytes), np.uint8)
                    read_at(file, self.start + offset + first * row_bytes, blocks)
                    for view, part in zip(views, convert(blocks, kind, layout[name][1], packed=len(views) > 1)):
                        view[first : first + len(blocks)] = part
        return {part: a.view(mx.bfloat16) if layout[part][1] == mx.bfloat16 else a for part, a in held.items()}


def dtype_np(dtype: mx.Dtype):
    return {mx.float16: np.float16, mx.float32: np.float32}[dtype]


def nbytes(kind: T, shape: tuple) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return math.prod(shape) // block * size


def read_at(file, offset: int, out: np.ndarray) -> None:
    """Fill `out` with the file's bytes from `offset` on."""
    file.seek(offset)
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise CheckpointError(f"{file.name} ends inside a tensor; re-download or re-convert it")
        done += count


def dequantizable(kind: T) -> bool:
    """Whether `gguf.quants` has a reference dequantizer for `kind`."""
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def convert(blocks: np.ndarray, kind: T, dtype: mx.Dtype, packed: bool) -> list[np.ndarray]:
    """Rows of raw blocks as the parts of their layout: packed words, scales (and biases), or one array of floats in
    `dtype` (bfloat16 as its bits)."""
    if kind in PACKED and packed:
        bits, unpack = PACKED[kind]
        q, *groups = unpack(blocks.reshape(-1, GGML_QUANT_SIZES[kind][1]))
        return [pack(q.reshape(len(blocks), -1), bits), *(g.reshape(len(blocks), -1) for g in groups if g is not None)]
    w = dequantize(blocks, kind)
    if not packed:
        return [
            np.array(mx.array(w).astype(dtype).view(mx.uint16)) if dtype == mx.bfloat16 else w.astype(dtype_np(dtype))
        ]
    q, scales, biases = affine(w, REPACKED_BITS.get(kind, 6))
    return [pack(q, REPACKED_BITS.get(kind, 6)), scales, biases]


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, parsed; one line saying so when it is not one."""
    try:
        return GGUFFile(path)
    except CheckpointError:
        raise
    except Exception as e:  # not a GGUF, truncated, corrupt: many kinds of errors
        reason = " ".join(str(e).split()).rstrip(".") or type(e).__name__
        raise CheckpointError(f"cannot read GGUF file {path}: {reason}; re-download or re-convert it") from None


def read_gguf(
    path: str | Path, dequantized_dtype: mx.Dtype | None = None, names=None, stored: frozenset = frozenset()
) -> tuple[dict[str, mx.array], dict]:
    """Tensors (named as in the file, shapes row-major) and metadata (Python values; arrays as lists); only the
    tensors `names` lists when given (the file's names); matrices of the types in `stored` as stored."""
    file = open_gguf(path)
    tensors = {}
    for name in file.tensors if names is None else names:
        tensors.update(file.read(name, dequantized_dtype, stored))
    return tensors, file.metadata


def affine(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of floats as MLX affine groups of 32: unsigned `bits`-bit values q, float16 scales and biases (the
    group's range over the levels, and its minimum), q rounded against the float16 ones."""
    groups = w.reshape(len(w), -1, 32)
    low, high = groups.min(-1), groups.max(-1)
    scales, biases = ((high - low) / (2**bits - 1)).astype(np.float16), low.astype(np.float16)
    step = scales.astype(np.float32)[..., None]
    q = np.rint((groups - biases.astype(np.float32)[..., None]) / np.where(step > 0, step, 1))
    return np.clip(q, 0, 2**bits - 1).astype(np.uint8).reshape(w.shape), scales, biases


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


def q4_k(blocks):  # 8 groups of 32 per block: w = d * sc * q - dmin * m (sc, m 6-bit)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = f16(blocks, 0).astype(np.float32), f16(blocks, 2).astype(np.float32)
    scales, biases = (d * sc).astype(np.float16), (-(dmin * m)).astype(np.float16)  # rounded: 2^-11 relative
    return nibbles(blocks[:, 16:].reshape(-1, 32)).reshape(len(blocks), -1), scales, biases


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
ROUNDED = {T.Q4_K, T.Q5_K}  # whose float16 scales and biases are rounded: a float dtype reads them exactly instead
REPACKED_BITS = {T.Q6_K: 8}  # the others re-packed, at 6 bits: at least the precision each type stores
