"""Where a model's blocks go when it is split across machines: one contiguous range of blocks per rank,
balanced by bytes rather than by count, so that the ranks that also hold the embedding and the head are not
the ones that run out of memory.

The same split serves the ranges that `--pipeline` runs and the plan `minimlx anatomy MODEL --ranks N` prints
from a config alone (`anatomy.placement`).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..core.latent_attention import LatentAttention
from ..errors import InvalidSettingError

BEFORE = ("embed", "positions")  # what the first rank holds besides its blocks; the rest (final norm, head) is last


def section_bytes(named: Iterable[tuple[str, mx.array]], layers: int, tied_head: bool) -> tuple[int, list[int], int]:
    """(bytes before the blocks, bytes of each block, bytes after them) of tensors named as the model names
    its parameters. The embeddings come before, the final norm and the head after; a tied head needs the
    embedding at the end too, so it counts on both sides."""
    before, blocks, after = 0, [0] * layers, 0
    for name, array in named:
        top, _, rest = name.partition(".")
        if top == "layers":
            blocks[int(rest.partition(".")[0])] += array.nbytes
        elif top in BEFORE:
            before += array.nbytes
            after += array.nbytes if tied_head and top == "embed" else 0
        else:
            after += array.nbytes
    return before, blocks, after


def balance(blocks: list[int], parts: int, before: int = 0, after: int = 0) -> list[range]:
    """Contiguous ranges of `blocks` (their bytes), one per part and none empty, that make the largest part as
    small as possible; the first part also holds `before` bytes and the last `after` bytes."""
    n = len(blocks)
    if not 1 <= parts <= n:
        raise InvalidSettingError(f"{n} blocks cannot be split over {parts} ranks; use 1 to {n} ranks")
    prefix = [0, *accumulate(blocks)]

    def load(part: int, start: int, stop: int) -> int:
        return prefix[stop] - prefix[start] + (before if part == 0 else 0) + (after if part == parts - 1 else 0)

    # best[p][i]: the smallest largest part placing blocks[:i] on parts 0..p-1; cut[p][i]: where part p-1 starts
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):
                cost = max(best[p - 1][j], load(p - 1, j, i))
                if cost < best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    bounds.reverse()
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


@dataclass
class RankPlan:
    """What one rank of a pipeline holds: its blocks, its weight bytes, its KV cache bytes per 1K tokens."""

    blocks: range
    weight_bytes: int
    kv_bytes_per_1k: int


def cache_bytes_per_token(layer: nn.Module, itemsize: int) -> int:
    """Bytes one token adds to a layer's cache: keys and values of every KV head, or one latent and its rope key; none
    to a recurrent layer's, whose state stays the same size."""
    attn = layer.attn
    if not attn.attends:
        return 0
    if isinstance(attn, LatentAttention):
        return (attn.latent_dims + attn.rope_dims) * itemsize
    return 2 * attn.kv_heads * attn.head_dim * itemsize


def plan(model: nn.Module, ranks: int) -> list[RankPlan]:
    """The pipeline placement of a built (lazy or loaded) model over `ranks` ranks, from its parameter shapes."""
    before, blocks, after = section_bytes(tree_flatten(model.parameters()), len(model.layers), model.tied_head)
    itemsize = model.norm.weight.dtype.size  # the activations' dtype, which the cache keeps
    out = []
    for r, span in enumerate(balance(blocks, ranks, before, after)):
        weights = sum(blocks[i] for i in span) + (before if r == 0 else 0) + (after if r == ranks - 1 else 0)
        kv = sum(cache_bytes_per_token(model.layers[i], itemsize) for i in span) * 1024
        out.append(RankPlan(span, weights, kv))
    return out
