"""A vision encoder over pictures of any size whose patch vectors are average-pooled into soft tokens (Gemma 4's).

Each picture comes as its patches, flattened (row, column, channel) in row-major order, with its grid (rows, columns).
A patch is mapped from [0, 1] to [-1, 1], projected to the encoder's width and given its place twice: a learned
vector per column plus one per row (`AxialPatchEmbedding`), and 2D rotary positions in every block (the first half of
each head turned by the patch's column, the second by its row: `PlanarRotary.half_angles`). The blocks are Gemma's:
each sub-layer between an RMSNorm before and one after; queries and keys RMS-normed per head, values per head with no
weight, scores not scaled; a gated GELU FFN. Several pictures go through in one pass, each patch attending to its own
picture's only. Then each `pooling` x `pooling` square of patch vectors is averaged into one soft token, times
sqrt(width), optionally standardised (`(x - bias) * scale`), and projected (`UnscaledRMSNorm`, linear) to the language
model's width.
"""

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import merge_heads, split_heads
from .ffn import GatedFFN
from .grid_vision import grid_positions
from .norms import RMSNorm, UnscaledRMSNorm
from .vision import ImageEncoder, ImageInput, block_diagonal
from .windowed_vision import PlanarRotary, rotate_each_half


class ClippableLinear(nn.Module):
    """W x (no bias); with `clipped`, clip(W clip(x, input_min, input_max), output_min, output_max): input and output
    clamped to bounds the checkpoint stores (Gemma 4's towers with `use_clipped_linears`). The map itself is a plain
    `linear`, which quantizes as any other."""

    def __init__(self, input_dims: int, output_dims: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(input_dims, output_dims, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min, self.input_max = mx.array(-np.inf), mx.array(np.inf)
            self.output_min, self.output_max = mx.array(-np.inf), mx.array(np.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        y = self.linear(mx.minimum(mx.maximum(x, self.input_min), self.input_max))
        return mx.minimum(mx.maximum(y, self.output_min), self.output_max)


class AxialPatchEmbedding(nn.Module):
    """Flattened patches in [0, 1] -> proj(2x - 1) + column_table[column] + row_table[row]."""

    def __init__(self, features: int, dims: int, table_size: int):
        super().__init__()
        self.proj = nn.Linear(features, dims, bias=False)
        self.position_table = mx.zeros((2, table_size, dims))  # (column, row) embeddings

    def __call__(self, patches: mx.array, positions: np.ndarray) -> mx.array:
        """patches (patches, features), positions (patches, 2) as (column, row) -> (patches, dims)."""
        x = self.proj((2 * (patches - 0.5)).astype(self.position_table.dtype))  # the tower's dtype, quantized or not
        columns, rows = mx.array(positions[:, 0]), mx.array(positions[:, 1])
        return x + self.position_table[0][columns] + self.position_table[1][rows]


class NormedHeadsAttention(nn.Module):
    """softmax(q k^T) v (unscaled) over the patches a mask allows: queries and keys RMS-normed per head (with weights)
    and turned by axial 2D RoPE, values RMS-normed per head (no weight)."""

    def __init__(self, dims: int, heads: int, head_dims: int, eps: float, clipped: bool = False):
        super().__init__()
        self.heads = heads
        self.q_proj = ClippableLinear(dims, heads * head_dims, clipped)
        self.k_proj = ClippableLinear(dims, heads * head_dims, clipped)
        self.v_proj = ClippableLinear(dims, heads * head_dims, clipped)
        self.o_proj = ClippableLinear(heads * head_dims, dims, clipped)
        self.q_norm, self.k_norm = RMSNorm(head_dims, eps), RMSNorm(head_dims, eps)
        self.v_norm = UnscaledRMSNorm(head_dims, eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        q, k, v = (split_heads(proj(x), self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate_each_half(self.q_norm(q), cos, sin), rotate_each_half(self.k_norm(k), cos, sin)
        out = mx.fast.scaled_dot_product_attention(q, k, self.v_norm(v), scale=1.0, mask=mask)
        return self.o_proj(merge_heads(out))


class SandwichBlock(nn.Module):
    """x + post(attn(pre(x))), then + post(ffn(pre(.))): each sub-layer between two RMSNorms (Gemma's block)."""

    def __init__(
        self, dims: int, hidden_dims: int, heads: int, head_dims: int, eps: float, activation: str, clipped: bool
    ):
        super().__init__()
        self.attn_norm, self.post_attn_norm = RMSNorm(dims, eps), RMSNorm(dims, eps)
        self.attn = NormedHeadsAttention(dims, heads, head_dims, eps, clipped)
        self.ffn_norm, self.post_ffn_norm = RMSNorm(dims, eps), RMSNorm(dims, eps)
        self.ffn = GatedFFN(dims, hidden_dims, activation)
        # the FFN's maps clippable too (a GatedFFN over ClippableLinears)
        self.ffn.gate_proj = ClippableLinear(dims, hidden_dims, clipped)
        self.ffn.up_proj = ClippableLinear(dims, hidden_dims, clipped)
        self.ffn.down_proj = ClippableLinear(hidden_dims, dims, clipped)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, mask: mx.array | None) -> mx.array:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, mask))
        return x + self.post_ffn_norm(self.ffn(self.ffn_norm(x)))


def pool_squares(x: mx.array, grid: tuple[int, int], k: int) -> mx.array:
    """One picture's patch vectors (rows * columns, dims) -> (rows/k * columns/k, dims): each k x k square's mean,
    squares in row-major order."""
    rows, cols = grid
    squares = x.reshape(rows // k, k, cols // k, k, x.shape[-1])
    return squares.mean(axis=(1, 3)).reshape(-1, x.shape[-1])


class PooledGridEncoder(ImageEncoder):
    """Pictures of any size (`ImageInput`s: flattened patches and their grid (rows, columns)) -> their soft tokens
    (`pooling`-squares of patches), image after image, each's in row-major order."""

    def __init__(
        self,
        dims: int,
        hidden_dims: int,
        layers: int,
        heads: int,
        head_dims: int,
        features: int,
        table_size: int,
        pooling: int,
        text_dims: int,
        rope_base: float,
        eps: float,
        activation: str,
        standardize: bool,
        clipped: bool = False,
    ):
        super().__init__()
        self.pooling, self.dims = pooling, dims
        self.embed = AxialPatchEmbedding(features, dims, table_size)
        block = (dims, hidden_dims, heads, head_dims, eps, activation, clipped)
        self.layers = [SandwichBlock(*block) for _ in range(layers)]
        self.rope = PlanarRotary(head_dims, rope_base)
        if standardize:
            self.std_bias, self.std_scale = mx.zeros((dims,)), mx.ones((dims,))
        self.projector_norm = UnscaledRMSNorm(dims, eps)
        self.projection = nn.Linear(dims, text_dims, bias=False)

    def __call__(self, images: Sequence[ImageInput]) -> mx.array:
        grids = [image.grid for image in images]
        positions = grid_positions(grids)[:, ::-1]  # (column, row): the first half of a head turns by the column
        x = self.embed(mx.array(np.concatenate([image.pixels for image in images])), positions)[None]
        cos, sin = self.rope.half_angles(positions)
        mask = block_diagonal([rows * cols for rows, cols in grids])
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        starts = np.cumsum([0] + [rows * cols for rows, cols in grids])
        x = x[0].astype(mx.float32)
        pooled = mx.concatenate([pool_squares(x[a:b], g, self.pooling) for a, b, g in zip(starts, starts[1:], grids)])
        pooled = pooled * self.dims**0.5
        if "std_bias" in self:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        pooled = pooled.astype(self.embed.position_table.dtype)
        return self.projection(self.projector_norm(pooled))
