"""A vision encoder over pictures of any size (Pixtral's): each picture's patches keep their place as 2D rotary
positions (row, column: `PlanarRotary`) instead of a learned embedding, and several pictures go through in one pass,
each patch attending to the patches of its own picture only (block-diagonal attention).

Pixels (channels, height, width), height and width multiples of the patch, are cut into patches, each flattened
(channel, row, column) and projected (the stride-`patch` convolution as the matmul it is), RMS-normed, then run
through pre-norm blocks (RMSNorm -> attention with 2D RoPE -> added; RMSNorm -> gated FFN -> added). A projector
(`MergedProjector`) RMS-norms the patch vectors, merges each `merge` x `merge` square of neighbours into one
vector and maps it to the language model's width with a linear-GELU-linear.
"""

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import merge_heads, split_heads
from .ffn import ACTIVATIONS, GatedFFN
from .norms import RMSNorm
from .vision import ImageEncoder, ImageInput, block_diagonal, patches_of
from .windowed_vision import PlanarRotary, rotate_halves


def grid_positions(grids: Sequence[tuple[int, int]]) -> np.ndarray:
    """(patches, 2): each patch's (row, column) in its grid (rows, columns), row-major, grid after grid."""
    rows = np.concatenate([np.repeat(np.arange(r), c) for r, c in grids])
    return np.stack([rows, np.concatenate([np.tile(np.arange(c), r) for r, c in grids])], axis=-1)


class GridAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v over the patches a mask allows, queries and keys turned by 2D RoPE."""

    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dims, dims, bias=False)
        self.k_proj = nn.Linear(dims, dims, bias=False)
        self.v_proj = nn.Linear(dims, dims, bias=False)
        self.o_proj = nn.Linear(dims, dims, bias=False)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        q, k, v = (split_heads(proj(x), self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        scale = (x.shape[-1] // self.heads) ** -0.5
        return self.o_proj(merge_heads(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)))


class GridBlock(nn.Module):
    """x + attn(rms(x)), then + ffn(rms(.)): a pre-norm block with a gated FFN."""

    def __init__(self, dims: int, hidden_dims: int, heads: int, eps: float, activation: str):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dims, eps), GridAttention(dims, heads)
        self.ffn_norm, self.ffn = RMSNorm(dims, eps), GatedFFN(dims, hidden_dims, activation)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class GridEncoder(nn.Module):
    """Pictures of any size (each (channels, height, width)) -> one vector per patch, picture after picture: the
    patches projected and RMS-normed, then the blocks over all pictures at once (block-diagonal attention).
    `feature_layer` picks the hidden state handed on (0: the normed patches, i: block i's output, negative: from the
    end); the blocks after it are kept (the checkpoint holds them) but not run."""

    def __init__(
        self,
        dims: int,
        hidden_dims: int,
        layers: int,
        heads: int,
        patch: int,
        rope_base: float,
        channels: int = 3,
        eps: float = 1e-5,
        activation: str = "gelu",
        feature_layer: int = -1,
    ):
        super().__init__()
        self.patch = patch
        self.proj = nn.Linear(channels * patch * patch, dims, bias=False)
        self.norm = RMSNorm(dims, eps)
        self.layers = [GridBlock(dims, hidden_dims, heads, eps, activation) for _ in range(layers)]
        self.used = feature_layer % (layers + 1)
        self.rope = PlanarRotary(dims // heads, rope_base, offset_columns=True)

    def grid(self, pixels) -> tuple[int, int]:
        """(rows, columns) of patches of a picture (channels, height, width)."""
        return pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch

    def __call__(self, pictures: Sequence[mx.array]) -> mx.array:
        """Pictures -> (patches of all, dims)."""
        grids = [self.grid(p) for p in pictures]
        dtype = self.proj.weight.dtype
        x = self.norm(self.proj(mx.concatenate([patches_of(p.astype(dtype), self.patch) for p in pictures])))[None]
        cos, sin = self.rope.angles(grid_positions(grids))
        mask = block_diagonal([r * c for r, c in grids])
        for layer in self.layers[: self.used]:
            x = layer(x, cos, sin, mask)
        return x[0]


def merge_squares(x: mx.array, grid: tuple[int, int], merge: int) -> mx.array:
    """One picture's patch vectors (rows * columns, dims) -> (rows/merge * columns/merge, dims * merge**2): each
    merge x merge square of neighbours, in row-major order of squares, its vectors laid side by side feature-major
    (feature, row in square, column in square), as torch's `unfold` lays them."""
    rows, cols = grid
    dims = x.shape[-1]
    squares = x.reshape(rows // merge, merge, cols // merge, merge, dims).transpose(0, 2, 4, 1, 3)
    return squares.reshape((rows // merge) * (cols // merge), dims * merge * merge)


class MergedProjector(nn.Module):
    """Patch vectors -> soft tokens: RMS-normed, each merge x merge square merged into one vector (`merge_squares`
    then a linear map back to the encoder's width), then linear-GELU-linear to the language model's width."""

    def __init__(self, dims: int, text_dims: int, merge: int, eps: float, activation: str, bias: bool):
        super().__init__()
        self.merge = merge
        self.norm = RMSNorm(dims, eps)
        self.merging = nn.Linear(dims * merge * merge, dims, bias=False)
        self.linear_1 = nn.Linear(dims, text_dims, bias=bias)
        self.linear_2 = nn.Linear(text_dims, text_dims, bias=bias)
        self.activation = ACTIVATIONS[activation]

    def __call__(self, patches: mx.array, grids: Sequence[tuple[int, int]]) -> mx.array:
        """(patches of all pictures, dims) with each picture's grid -> (soft tokens of all, text dims)."""
        x = self.norm(patches)
        starts = np.cumsum([0] + [r * c for r, c in grids])
        merged = [merge_squares(x[a:b], grid, self.merge) for a, b, grid in zip(starts[:-1], starts[1:], grids)]
        x = self.merging(mx.concatenate(merged))
        return self.linear_2(self.activation(self.linear_1(x)))


class GridImageEncoder(ImageEncoder):
    """A `GridEncoder` and its `MergedProjector`: images of any size (pixels (channels, height, width), height and
    width multiples of `patch * merge`) to their soft tokens, image after image, each's in row-major order."""

    def __init__(self, encoder: GridEncoder, projector: MergedProjector):
        super().__init__()
        self.encoder, self.projector = encoder, projector

    def __call__(self, images: Sequence[ImageInput]) -> mx.array:
        pictures = [mx.array(image.pixels) for image in images]
        return self.projector(self.encoder(pictures), [self.encoder.grid(p) for p in pictures])
