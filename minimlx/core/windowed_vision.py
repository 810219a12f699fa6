"""A vision encoder over pictures of any size (Qwen2.5-VL's): flattened patches projected to the encoder's width,
2D rotary positions (a patch's row turns half the rotated frequencies, its column the other half), pre-norm blocks
whose attention sees the patches of one window (a square of merge blocks) or, in the full-attention blocks, the
whole picture (Qwen2-VL: every block); then a merger that joins each `merge` x `merge` block of patch vectors into
one soft token.

The processor hands the patches ordered merge block by merge block (`DynamicResolutionPatches`); the encoder
reorders those blocks window by window, so that each window's patches lie together, and puts the soft tokens back
in merge-block order at the end.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import merge_heads, split_heads
from .ffn import ACTIVATIONS
from .vision import ImageEncoder, ImageInput


def merge_block_positions(rows: int, cols: int, merge: int) -> np.ndarray:
    """(rows * cols, 2): each patch's (row, column), the patches ordered merge block by merge block."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    shape = (rows // merge, merge, cols // merge, merge)
    return np.stack([a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (r, c)], axis=-1)


def window_order(frames: int, rows: int, cols: int, window: int) -> tuple[np.ndarray, list[int]]:
    """(the merge blocks of a `frames` x `rows` x `cols` grid of them, window by window: `window` x `window` blocks
    from the top left, row-major within each; the blocks in each window, empty windows left out)."""
    index = np.arange(frames * rows * cols).reshape(frames, rows, cols)
    high, wide = (rows // window + 1) * window, (cols // window + 1) * window  # padded as transformers pads
    padded = np.full((frames, high, wide), -1)
    padded[:, :rows, :cols] = index
    windows = padded.reshape(frames, high // window, window, wide // window, window).transpose(0, 1, 3, 2, 4)
    windows = windows.reshape(-1, window * window)
    sizes = (windows >= 0).sum(axis=1)
    order = windows.reshape(-1)
    return order[order >= 0], [int(n) for n in sizes if n]


class FlatPatchEmbedding(nn.Module):
    """Flattened patches (patches, channels * frames * p * p) projected to the encoder's width: a 3D convolution of
    stride its kernel, written as the matmul it is."""

    def __init__(self, features: int, dims: int, bias: bool = False):
        super().__init__()
        self.proj = nn.Linear(features, dims, bias=bias)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


class InterpolatedPositions(nn.Module):
    """A learned `side` x `side` table of position embeddings resampled to each picture's patch grid, bilinearly with
    the corners aligned (the table's corners land on the grid's corners), as `F.interpolate` resamples it (Qwen3-VL's
    tower)."""

    def __init__(self, side: int, dims: int):
        super().__init__()
        self.side = side
        self.weight = mx.zeros((side * side, dims))

    def __call__(self, positions: np.ndarray, rows: int, cols: int) -> mx.array:
        """positions (patches, 2): each patch's (row, column) on a `rows` x `cols` grid -> (patches, dims)."""
        (r, wr), (c, wc) = (self.taps(positions[:, i], n) for i, n in ((0, rows), (1, cols)))
        index = (r[:, :, None] * self.side + c[:, None, :]).reshape(len(positions), 4)
        weight = (wr[:, :, None] * wc[:, None, :]).reshape(len(positions), 4)
        return (self.weight[mx.array(index)] * mx.array(weight)[..., None].astype(self.weight.dtype)).sum(axis=1)

    def taps(self, at: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The two table rows either side of each of `at` (on an axis of `size` patches) and their weights."""
        source = at.astype(np.float32) * np.float32(self.side - 1) / np.float32(max(size - 1, 1))
        low = np.floor(source)
        taps = low.astype(int)[:, None] + np.arange(2)
        weights = np.clip(1 - np.abs(source[:, None] - taps), 0, None).astype(np.float32)
        return np.clip(taps, 0, self.side - 1), weights


class PlanarRotary:
    """2D rotary positions over heads of `head_dims`: the first half of the rotated pairs turned by the patch's row,
    the second by its column (rotate-half pairs over the whole head), both at frequencies base ** (-4i / head_dims);
    with `offset_columns`, the columns at the frequencies between those, base ** (-(4i + 2) / head_dims) (Pixtral's:
    the row takes the even frequencies of a 1D RoPE over the head, the column the odd ones)."""

    def __init__(self, head_dims: int, base: float = 10000.0, offset_columns: bool = False):
        freqs = base ** (-np.arange(0, head_dims, 2, dtype=np.float32) / head_dims)
        self.inv_freq = np.stack([freqs[0::2], freqs[1::2] if offset_columns else freqs[0::2]])  # (row, column)

    def angles(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        """positions (patches, 2) -> cos, sin (patches, head_dims)."""
        turns = (positions[:, :, None].astype(np.float32) * self.inv_freq).reshape(len(positions), -1)
        turns = mx.array(np.concatenate([turns, turns], axis=-1))
        return mx.cos(turns), mx.sin(turns)

    def half_angles(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        """positions (patches, 2) -> cos, sin (patches, head_dims) laid out for `rotate_each_half`: the first half of
        the head turned by the first axis alone, the second by the second (Gemma 4's axial RoPE), at the same
        frequencies."""
        turns = positions[:, :, None].astype(np.float32) * self.inv_freq  # (patches, 2, head_dims / 4)
        turns = mx.array(np.concatenate([turns[:, 0], turns[:, 0], turns[:, 1], turns[:, 1]], axis=-1))
        return mx.cos(turns), mx.sin(turns)


def rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (heads, tokens, head_dims) turned by rotate-half pairs in float32, in x's dtype."""
    half = x.shape[-1] // 2
    y = x.astype(mx.float32)
    turned = mx.concatenate([-y[..., half:], y[..., :half]], axis=-1)
    return (y * cos + turned * sin).astype(x.dtype)


def rotate_each_half(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (heads, tokens, head_dims) with each half of every head turned by rotate-half pairs within it (angles from
    `PlanarRotary.half_angles`)."""
    half = x.shape[-1] // 2
    return mx.concatenate(
        [
            rotate_halves(x[..., :half], cos[..., :half], sin[..., :half]),
            rotate_halves(x[..., half:], cos[..., half:], sin[..., half:]),
        ],
        axis=-1,
    )


@dataclass(frozen=True)
class Windows:
    """Runs of consecutive patches that attend among themselves: `gather` (windows, longest) their indices (padding
    rows point at patch 0), `valid` (windows, longest) which of those are patches, and `scatter` each patch's place
    in the windows laid end to end. Attention then runs on a batch of windows, not on the whole picture."""

    gather: mx.array
    valid: mx.array
    scatter: mx.array

    @classmethod
    def of(cls, sizes: Sequence[int]) -> "Windows":
        """Windows of `sizes` patches, one after another."""
        longest, starts = max(sizes), np.cumsum([0, *sizes[:-1]])
        valid = np.arange(longest)[None, :] < np.asarray(sizes)[:, None]
        gather = np.where(valid, starts[:, None] + np.arange(longest)[None, :], 0)
        return cls(mx.array(gather), mx.array(valid), mx.array(np.nonzero(valid.reshape(-1))[0]))


class WindowedEncoderAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v both ways, within each of the `windows` (over the whole picture without);
    queries and keys turned by 2D rotary positions."""

    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dims, 3 * dims)
        self.proj = nn.Linear(dims, dims)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, windows: Windows | None) -> mx.array:
        """x (1, patches, dims)."""
        q, k, v = (split_heads(part, self.heads) for part in mx.split(self.qkv(x), 3, axis=-1))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        scale = (x.shape[-1] // self.heads) ** -0.5
        if windows is None:
            return self.proj(merge_heads(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)))
        q, k, v = (t[0][:, windows.gather].transpose(1, 0, 2, 3) for t in (q, k, v))  # (windows, heads, longest, hd)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=windows.valid[:, None, None, :])
        return self.proj(out.transpose(0, 2, 1, 3).reshape(-1, x.shape[-1])[windows.scatter][None])


class RotaryEncoderBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)): a pre-norm encoder block whose attention turns queries and keys by 2D
    rotary positions and sees the patches of its window. Its norms and FFN are the family's (RMSNorm and a gated FFN
    in Qwen2.5-VL, LayerNorm and a plain MLP in Qwen2-VL)."""

    def __init__(self, dims: int, heads: int, norm1: nn.Module, norm2: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm1, self.attn = norm1, WindowedEncoderAttention(dims, heads)
        self.norm2, self.mlp = norm2, mlp

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, windows: Windows | None) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each run of `merge * merge` patch vectors (a merge block) normed (`norm`), joined into one vector and projected
    by a GELU MLP to the language model's width; with `norm_joined`, normed once joined (`norm` of the joined width:
    Qwen3-VL's DeepStack mergers)."""

    def __init__(self, dims: int, text_dims: int, merge: int, norm: nn.Module, norm_joined: bool = False):
        super().__init__()
        self.joined, self.norm_joined = dims * merge * merge, norm_joined
        self.norm = norm
        self.up, self.down = nn.Linear(self.joined, self.joined), nn.Linear(self.joined, text_dims)

    def __call__(self, x: mx.array) -> mx.array:
        joined = self.norm(x.reshape(-1, self.joined)) if self.norm_joined else self.norm(x).reshape(-1, self.joined)
        return self.down(ACTIVATIONS["gelu"](self.up(joined)))


class WindowedVisionEncoder(ImageEncoder):
    """Pictures of any size (patches and a (frames, rows, columns) patch grid each) -> one soft token per merge block:
    flat patch embedding (plus learned `positions` resampled to the grid, Qwen3-VL's), then `layers`
    (`RotaryEncoderBlock`s) attending within windows of `window` merge blocks a side, except the `full_layers` (every
    layer without a window), which see the whole picture; then the merger.

    DeepStack (Qwen3-VL): the outputs of the `deepstack_layers` go through their own `deepstack` mergers too, and the
    encoder returns (1 + len(deepstack), places, text dims): the soft tokens, then the features the language model
    adds at the same places after its first layers (`PlacedImages`)."""

    def __init__(
        self,
        embed: FlatPatchEmbedding,
        layers: list[nn.Module],
        merger: PatchMerger,
        head_dims: int,
        merge: int,
        window: int | None = None,
        full_layers: Sequence[int] = (),
        rope_base: float = 10000.0,
        positions: InterpolatedPositions | None = None,
        deepstack: Sequence[PatchMerger] = (),
        deepstack_layers: Sequence[int] = (),
    ):
        super().__init__()
        self.embed, self.layers, self.merger = embed, layers, merger
        if positions is not None:
            self.positions = positions
        if deepstack:
            self.deepstack = list(deepstack)
        self.deepstack_layers = tuple(deepstack_layers)
        self.merge, self.window = merge, window
        self.full_layers = tuple(range(len(layers))) if window is None else tuple(full_layers)
        self.rotary = PlanarRotary(head_dims, rope_base)

    def __call__(self, images: Sequence[ImageInput]) -> mx.array:
        return mx.concatenate([self.encode(image) for image in images], axis=-2)

    def encode(self, image: ImageInput) -> mx.array:
        """One picture -> (merge blocks, text dims), in merge-block order ((1 + DeepStack levels, ...) with them)."""
        frames, rows, cols = image.grid
        m, unit = self.merge, self.merge * self.merge
        blocks = frames * (rows // m) * (cols // m)
        order, sizes = window_order(frames, rows // m, cols // m, self.window) if self.window else (None, [blocks])
        patches = np.arange(blocks * unit) if order is None else (order[:, None] * unit + np.arange(unit)).reshape(-1)
        x = self.embed(mx.array(image.pixels[patches]).astype(self.embed.proj.weight.dtype))
        grid = np.tile(merge_block_positions(rows, cols, m), (frames, 1))[patches]
        if "positions" in self:
            x = x + self.positions(grid, rows, cols).astype(x.dtype)
        x = x[None]
        cos, sin = self.rotary.angles(grid)
        windowed = Windows.of([n * unit for n in sizes]) if len(sizes) > 1 else None
        levels = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if i in self.full_layers else windowed)
            if i in self.deepstack_layers:
                levels.append(self.deepstack[self.deepstack_layers.index(i)](x[0]))
        merged = mx.stack([self.merger(x[0]), *levels]) if levels else self.merger(x[0])
        return merged if order is None else merged[..., mx.array(np.argsort(order)), :]
