"""Quantized weights: what a checkpoint holds, how it runs, and quantizing a model in memory.

A quantized module stores its weight packed into `uint32` words with a `scales` tensor (and, in
MLX's `affine` mode, a `biases` tensor) per group of `group_size` input features, the layout
`mx.quantize` writes. Quantization belongs to the weights, not to the architecture: a module is
quantized when the checkpoint holds `scales` beside its weight, and its bits and group size follow
from the packed shapes. The `quantization` entry of an MLX folder's config.json (mlx-lm's
`{group_size, bits, mode}`, plus per-module entries for mixed recipes) names the mode and is
checked against those shapes. Hugging Face's `quantization_config` with `quant_method: mxfp4` (gpt-oss) names
MLX's `mxfp4` mode: its checkpoints' `*_blocks` hold the same bytes as MLX's packed weights (`mxfp4_from_blocks`)
and its `*_scales` the same E8M0 exponents.

How the packed weights run is the caller's choice: kept packed (`mx.quantized_matmul`,
`mx.gather_qmm`, or on the CPU the optional native kernel's forms in `cpu.linear`), or dequantized once at load into
a float dtype.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .errors import CheckpointError, InvalidSettingError

# mode -> (default group size, default bits, the bits it supports)
MODES = {"affine": (64, 4, (2, 3, 4, 5, 6, 8)), "mxfp4": (32, 4, (4,)), "mxfp8": (32, 8, (8,)), "nvfp4": (16, 4, (4,))}
RECIPES = {"mixed-2-6": (2, 6), "mixed-3-4": (3, 4), "mixed-3-6": (3, 6), "mixed-4-6": (4, 6)}
FIX = "re-convert the model (minimlx convert or mlx_lm.convert)"
HF_METHODS = {"mxfp4": "mxfp4"}  # Hugging Face quant_method -> the MLX mode of the same numbers
SCALED_FLOAT_MODES = {
    (32, 4): "mxfp4",
    (32, 8): "mxfp8",
    (16, 4): "nvfp4",
}  # (group size, bits): uint8 scales, no biases


BLOCK_MODES = {"q8_0": (8, 32, 34, 8), "q4_k": (12, 256, 144, 4), "q5_k": (13, 256, 176, 5), "q6_k": (14, 256, 210, 6)}
"""GGUF's block types held as the file stores them (io/gguf_file.py, where the native CPU kernel reads them): mode ->
(ggml's number for the type, values per block, bytes per block, the bits of its codes). Such a weight is one uint8
array, (rows, bytes of a row's blocks), with no scales or biases beside it."""


def block_mode(packed: tuple, in_dims: int) -> str | None:
    """The block mode whose rows of `in_dims` values take `packed[-1]` bytes, if any."""
    for mode, (_, values, size, _) in BLOCK_MODES.items():
        if in_dims % values == 0 and packed[-1] == in_dims // values * size:
            return mode
    return None


def declared(entry: dict | None) -> tuple[str, set[int], set[int]]:
    """Mode, bit widths and group sizes an MLX config's `quantization` entry declares; unusable ones refused."""
    entry = entry or {}
    mode = entry.get("mode") or HF_METHODS.get(entry.get("quant_method"), "affine")
    if mode not in MODES:
        raise CheckpointError(f"config.json quantization mode {mode!r} is unknown; minimlx reads {', '.join(MODES)}")
    params = [entry] + [v for v in entry.values() if isinstance(v, dict)]
    bits = {p["bits"] for p in params if "bits" in p}
    groups = {p["group_size"] for p in params if "group_size" in p}
    for p in params:
        if p.get("bits") is not None and p["bits"] not in MODES[p.get("mode", mode)][2]:
            raise CheckpointError(
                f"config.json quantization has bits={p['bits']!r}, which {p.get('mode', mode)} quantization cannot "
                f"use (supported: {', '.join(map(str, MODES[p.get('mode', mode)][2]))}); {FIX}"
            )
    return mode, bits, groups


def packed_modules(model: nn.Module, weights: dict[str, mx.array], entry: dict | None = None) -> dict[str, dict]:
    """`{module path: {group_size, bits, mode}}` for each module whose weight `weights` holds packed.

    `model` is the unquantized model, whose weight shapes give the input width each packed shape is
    checked against; `entry` is the config's `quantization` entry (None for files that carry their
    quantization in the tensors, like GGUF). In a folder that mixes modes (say mxfp4 experts beside
    affine 8-bit attention) each module's mode is the one its tensors are in: affine ones have `biases`,
    the floating-point formats uint8 scales and none.
    """
    mode, bits_declared, groups_declared = declared(entry)
    params = dict(tree_flatten(model.parameters()))
    spec = block_modules(params, weights)
    for name in weights:
        module = name.removesuffix(".scales")
        if not name.endswith(".scales") or f"{module}.weight" not in params or f"{module}.weight" not in weights:
            continue  # not a packed module of this model: reported as unexpected by check_weights
        in_dims = params[f"{module}.weight"].shape[-1]
        packed, scales = weights[f"{module}.weight"].shape, weights[name].shape
        bits, group_size = packed[-1] * 32 / in_dims, in_dims / scales[-1] if scales[-1] else math.nan
        module_mode = mode
        if f"{module}.biases" in weights:
            module_mode = "affine"
        elif weights[name].dtype == mx.uint8:
            module_mode = SCALED_FLOAT_MODES.get((group_size, bits), mode)
        fits = (
            bits in MODES[module_mode][2]
            and group_size.is_integer()
            and (module_mode == "affine" or group_size == MODES[module_mode][0])  # their groups have one size
            and (not bits_declared or bits in bits_declared)
            and (not groups_declared or group_size in groups_declared)
            and packed[:-1] == scales[:-1] == params[f"{module}.weight"].shape[:-1]
        )
        if not fits:
            expected = f"{', '.join(map(str, sorted(bits_declared)))}-bit" if bits_declared else "packed"
            raise CheckpointError(
                f"tensor {module}.weight has packed shape {tuple(packed)} with scales {tuple(scales)}, which does not "
                f"fit {expected} {module_mode} quantization of a {tuple(params[f'{module}.weight'].shape)} weight; "
                f"{FIX}"
            )
        spec[module] = {"group_size": int(group_size), "bits": int(bits), "mode": module_mode}
    return spec


def block_modules(params: dict[str, mx.array], weights: dict[str, mx.array]) -> dict[str, dict]:
    """The modules whose weight `weights` holds as GGUF blocks (`BLOCK_MODES`: uint8 rows of blocks, no scales)."""
    spec = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or w.dtype != mx.uint8 or f"{module}.scales" in weights or name not in params:
            continue
        shape = params[name].shape
        rows_fit = w.ndim == len(shape) in (2, 3) and w.shape[:-1] == shape[:-1]  # a matrix, or stacked experts'
        mode = block_mode(w.shape, shape[-1]) if rows_fit else None
        if mode is None:
            raise CheckpointError(
                f"tensor {name} holds {tuple(w.shape)} bytes, which are no GGUF block type's rows for a "
                f"{tuple(shape)} weight; {FIX}"
            )
        _, values, _, bits = BLOCK_MODES[mode]
        spec[module] = {"group_size": values, "bits": bits, "mode": mode}
    return spec


def dequantize_stored(blocks: mx.array, in_dims: int | None = None) -> mx.array:
    """The float32 weight of rows held as GGUF blocks (uint8, `BLOCK_MODES`), for a layout that must be re-ordered
    along its columns: the mode is the one whose rows of `in_dims` values take this many bytes, or when in_dims is not
    known, the only mode whose block size divides them."""
    if in_dims is not None:
        modes = [mode] if (mode := block_mode(blocks.shape, in_dims)) else []
    else:
        modes = [mode for mode, (_, _, size, _) in BLOCK_MODES.items() if blocks.shape[-1] % size == 0]
    if len(modes) != 1:
        raise CheckpointError(
            f"cannot tell the GGUF block type of a {tuple(blocks.shape)} byte tensor to re-order it; load the model "
            "with --dtype float32"
        )
    return dequantize_blocks(blocks, modes[0])


def dequantize_blocks(blocks: mx.array, mode: str) -> mx.array:
    """The float32 weight of one held as GGUF blocks (`BLOCK_MODES`), by gguf's reference dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as dequantize_gguf

    kind = GGMLQuantizationType(BLOCK_MODES[mode][0])
    return mx.array(dequantize_gguf(np.array(blocks, copy=False), kind).astype(np.float32))


def mxfp4_from_blocks(blocks: mx.array) -> mx.array:
    """Hugging Face MXFP4 blocks (..., groups, 16) uint8, 32 E2M1 values per group two to a byte (the lower nibble
    first), as MLX's packed mxfp4 weight (..., groups * 4) uint32: the same bytes, read as little-endian words."""
    return blocks.view(mx.uint32).flatten(-2)


def dequantize(packed: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int, mode: str):
    """The float32 weight of a packed one. Affine weights are unpacked as `scale * q + bias` in float32,
    the same numbers as `mx.dequantize` and several times faster on the CPU."""
    if mode in BLOCK_MODES:
        return dequantize_blocks(packed, mode)
    if mode != "affine":
        return mx.dequantize(packed, scales, biases, group_size, bits, mode=mode).astype(mx.float32)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32) if 32 % bits == 0 else None
    if shifts is None:  # 3, 5, 6 bits: values straddle words (float32 scales: MLX unpacks in the scales' dtype)
        return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    q = (packed[..., None] >> shifts) & (2**bits - 1)
    q = q.reshape(*scales.shape, -1).astype(mx.float32)
    w = q * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return w.reshape(*packed.shape[:-1], -1)


def dequantize_weights(weights: dict[str, mx.array], spec: dict[str, dict]) -> dict[str, mx.array]:
    """Replace each packed triple in `weights` by its float32 weight (lazily: nothing is computed until evaluated)."""
    for module, q in spec.items():
        scales, biases = weights.pop(f"{module}.scales", None), weights.pop(f"{module}.biases", None)
        weights[f"{module}.weight"] = dequantize(weights[f"{module}.weight"], scales, biases, **q)
    return weights


def quantize_modules(model: nn.Module, spec: dict[str, dict]) -> None:
    """Swap the modules `spec` names for their quantized forms (which then take the packed tensors)."""
    nn.quantize(model, class_predicate=lambda path, _: dict(spec[path]) if path in spec else False)


def quantize(
    model: nn.Module,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    recipe: str | None = None,
) -> dict:
    """Quantize a model in memory; returns the `quantization` entry that describes it (mlx-lm's layout:
    defaults, plus one entry per module whose settings differ from them).

    Every linear map, embedding and stack of experts whose input width is a multiple of the group size is
    quantized. A `recipe` (`mixed-3-6`, ...) gives the value projections and FFN down projections of the
    first and last eighth of the layers and of every third layer between, and an untied head, the higher
    bit width, the rest the lower one (the choices of llama.cpp's Q4_K_M, as mlx-lm's recipes make them).
    """
    if mode not in MODES:
        raise InvalidSettingError(f"unknown quantization mode {mode!r}; use one of {', '.join(MODES)}")
    default_group, default_bits, supported = MODES[mode]
    group_size = group_size or default_group
    if recipe is not None:
        if recipe not in RECIPES or mode != "affine":
            raise InvalidSettingError(
                f"unknown recipe {recipe!r} for {mode} quantization; recipes (affine only): {', '.join(RECIPES)}"
            )
        bits, high_bits = RECIPES[recipe]
    bits = bits or default_bits
    if bits not in supported:
        raise InvalidSettingError(f"{mode} quantization takes bits {', '.join(map(str, supported))}, not {bits}")
    entry = {"group_size": group_size, "bits": bits, "mode": mode}
    layers = len(model.layers)

    def more_bits(path: str) -> bool:
        parts = path.split(".")
        if parts[0] == "head":
            return True
        layer = int(parts[1]) if parts[0] == "layers" else 0
        edge = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        return edge and (path.endswith(".v_proj") or path.endswith("down_proj"))

    def choose(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        if recipe is not None and more_bits(path):
            entry[path] = {"group_size": group_size, "bits": high_bits, "mode": mode}
            return dict(entry[path])
        return dict(group_size=group_size, bits=bits, mode=mode)

    nn.quantize(model, class_predicate=choose)
    return entry
