"""A vision encoder over pictures of any size (Qwen2.5-VL's): flattened patches projected to the encoder's width,
2D rotary positions (a patch's row turns half the rotated frequencies, its column the other half), pre-RMSNorm blocks
whose attention sees the patches of one window (a square of merge blocks) or, in the full-attention blocks, the
whole picture; then a merger that joins each `merge` x `merge` block of patch vectors into one soft token.

The processor hands the patches ordered merge block by merge block (`DynamicResolutionPatches`); the encoder
reorders those blocks window by window, so that each window's patches lie together, and puts the soft tokens back
in merge-block order at the end.
"""

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import merge_heads, split_heads
from .ffn import ACTIVATIONS, GatedFFN
from .norms import RMSNorm
from .vision import ImageEncoder, ImageInput, block_diagonal


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

    def __init__(self, features: int, dims: int):
        super().__init__()
        self.proj = nn.Linear(features, dims, bias=False)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)


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


def rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (heads, tokens, head_dims) turned by rotate-half pairs in float32, in x's dtype."""
    half = x.shape[-1] // 2
    y = x.astype(mx.float32)
    turned = mx.concatenate([-y[..., half:], y[..., :half]], axis=-1)
    return (y * cos + turned * sin).astype(x.dtype)


class WindowedEncoderAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v both ways, within the windows `mask` allows (all of it without one); queries
    and keys turned by 2D rotary positions."""

    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dims, 3 * dims)
        self.proj = nn.Linear(dims, dims)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        """x (1, patches, dims)."""
        q, k, v = (split_heads(part, self.heads) for part in mx.split(self.qkv(x), 3, axis=-1))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        scale = (x.shape[-1] // self.heads) ** -0.5
        return self.proj(merge_heads(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)))


class GatedEncoderBlock(nn.Module):
    """x + attn(rmsnorm(x)), then + gated_ffn(rmsnorm(.)) (biased projections)."""

    def __init__(self, dims: int, hidden_dims: int, heads: int, activation: str, eps: float = 1e-6):
        super().__init__()
        self.norm1, self.attn = RMSNorm(dims, eps), WindowedEncoderAttention(dims, heads)
        self.norm2, self.mlp = RMSNorm(dims, eps), GatedFFN(dims, hidden_dims, activation, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each run of `merge * merge` patch vectors (a merge block) RMS-normed, joined into one vector and projected by a
    GELU MLP to the language model's width."""

    def __init__(self, dims: int, text_dims: int, merge: int, eps: float = 1e-6):
        super().__init__()
        self.joined = dims * merge * merge
        self.norm = RMSNorm(dims, eps)
        self.up, self.down = nn.Linear(self.joined, self.joined), nn.Linear(self.joined, text_dims)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(ACTIVATIONS["gelu"](self.up(self.norm(x).reshape(-1, self.joined))))


class WindowedVisionEncoder(ImageEncoder):
    """Pictures of any size (patches and a (frames, rows, columns) patch grid each) -> one soft token per merge block:
    flat patch embedding, `layers` gated blocks attending within windows of `window` merge blocks a side except the
    `full_layers`, which see the whole picture, and the patch merger."""

    def __init__(
        self,
        features: int,
        dims: int,
        hidden_dims: int,
        layers: int,
        heads: int,
        text_dims: int,
        merge: int,
        window: int,
        full_layers: Sequence[int],
        activation: str = "silu",
        rope_base: float = 10000.0,
    ):
        super().__init__()
        self.merge, self.window, self.full_layers = merge, window, tuple(full_layers)
        self.embed = FlatPatchEmbedding(features, dims)
        self.layers = [GatedEncoderBlock(dims, hidden_dims, heads, activation) for _ in range(layers)]
        self.merger = PatchMerger(dims, text_dims, merge)
        self.rotary = PlanarRotary(dims // heads, rope_base)

    def __call__(self, images: Sequence[ImageInput]) -> mx.array:
        return mx.concatenate([self.encode(image) for image in images], axis=0)

    def encode(self, image: ImageInput) -> mx.array:
        """One picture -> (merge blocks, text dims), in merge-block order."""
        frames, rows, cols = image.grid
        m, unit = self.merge, self.merge * self.merge
        order, sizes = window_order(frames, rows // m, cols // m, self.window)
        patches = (order[:, None] * unit + np.arange(unit)).reshape(-1)  # the patches, window by window
        x = self.embed(mx.array(image.pixels[patches]).astype(self.embed.proj.weight.dtype))[None]
        positions = np.tile(merge_block_positions(rows, cols, m), (frames, 1))[patches]
        cos, sin = self.rotary.angles(positions)
        windowed = block_diagonal(np.asarray(sizes) * unit)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if i in self.full_layers else windowed)
        return self.merger(x[0])[mx.array(np.argsort(order))]
