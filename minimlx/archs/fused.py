"""Fused projections: several linear maps stored as one matrix, their output rows stacked.

Checkpoints fuse q/k/v (`c_attn`, `qkv_proj`) or gate/up (`gate_up_proj`); minimlx's modules keep them
apart. Rows are the output dimension of a weight, its bias, and of a packed weight's scales and biases
alike, so the same split serves float and quantized tensors.
"""

import mlx.core as mx


def split_fused(
    weights: dict[str, mx.array], fused: str, parts: list[tuple[str, int]], axis: int = 0
) -> dict[str, mx.array]:
    """Each tensor of module `fused` (`...{fused}.weight`, `.bias`, ...) split into `parts`: (name, rows) in order,
    rows along `axis` (1 for stacked experts)."""
    cuts = [sum(rows for _, rows in parts[: i + 1]) for i in range(len(parts) - 1)]
    out = {}
    for name, w in weights.items():
        if f".{fused}." not in name:
            out[name] = w
            continue
        for (part, _), piece in zip(parts, mx.split(w, cuts, axis=axis)):
            out[name.replace(f".{fused}.", f".{part}.")] = piece
    return out


def fuse(weights: dict[str, mx.array], fused: str, parts: list[str]) -> dict[str, mx.array]:
    """The inverse of `split_fused`: the tensors of modules `parts` stacked into module `fused`."""
    out = {}
    for name, w in weights.items():
        if f".{parts[0]}." in name:
            pieces = [weights[name.replace(f".{parts[0]}.", f".{part}.")] for part in parts]
            out[name.replace(f".{parts[0]}.", f".{fused}.")] = mx.concatenate(pieces, axis=0)
        elif not any(f".{part}." in name for part in parts):
            out[name] = w
    return out
