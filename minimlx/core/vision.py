"""Vision encoders and the parts that hand their output to a language model.

The protocol every image-text family follows (each image may have its own size, grid and number of soft tokens):

1. the family's image processor (`minimlx.vision.ImageProcessor`) turns each picture into an `ImageInput`: its pixels
   and the grid facts its encoder needs (a patch grid, a tiling);
2. the family's config writes each image's places into the prompt from those facts (`image_places`,
   `expand_images`);
3. the family's `ImageEncoder` turns the images into their soft tokens, one row per place, image after image;
4. `PlacedImages` puts them at their places in the prompt's embeddings.

A picture (batch, channels, height, width) is cut into square patches, each flattened and projected to the
encoder's width, given a learned position, and run through pre-norm blocks whose attention sees every patch
(no mask, no cache). A projector turns the encoder's patch vectors into soft tokens of the language model's width;
`PlacedImages` says where in a prompt they go and which prompt tokens see each other both ways.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import merge_heads, split_heads
from .ffn import MLP
from .norms import LayerNorm, OffsetRMSNorm


def block_diagonal(lengths: Sequence[int]) -> mx.array | None:
    """A (tokens, tokens) mask letting the tokens of each consecutive span of `lengths` (a picture's patches, a
    window's) see each other only; None for one span (nothing hidden)."""
    if len(lengths) == 1:
        return None
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return mx.array(owner[:, None] == owner[None, :])


def patches_of(pixels: mx.array, patch: int) -> mx.array:
    """(..., channels, height, width) -> (..., rows * columns, channels * patch * patch): non-overlapping squares in
    row-major order, each flattened (channel, row, column) as a convolution's (dims, channels, p, p) kernel is, so
    the stride-`patch` convolution is a matmul with that kernel flattened."""
    *lead, channels, height, width = pixels.shape
    rows, cols, n = height // patch, width // patch, len(lead)
    squares = pixels[..., : rows * patch, : cols * patch].reshape(*lead, channels, rows, patch, cols, patch)
    squares = squares.transpose(*range(n), n + 1, n + 3, n, n + 2, n + 4)
    return squares.reshape(*lead, rows * cols, channels * patch * patch)


class PatchEmbedding(nn.Module):
    """Non-overlapping `patch` x `patch` squares, each flattened (channel, row, column) and projected: the
    convolution of stride `patch` written as the matmul it is (its (dims, channels, p, p) kernel flattened to
    `proj`'s weight); plus a learned embedding of each patch's place."""

    def __init__(self, channels: int, dims: int, patch: int, patches: int):
        super().__init__()
        self.patch = patch
        self.proj = nn.Linear(channels * patch * patch, dims)
        self.position_embedding = nn.Embedding(patches, dims)

    def __call__(self, pixels: mx.array) -> mx.array:
        """pixels (batch, channels, height, width) -> (batch, patches, dims), patches in row-major order."""
        squares = patches_of(pixels, self.patch)
        return self.proj(squares) + self.position_embedding(mx.arange(squares.shape[-2]))


class EncoderAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v over every position, both ways: an encoder's self-attention."""

    def __init__(self, dims: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dims, dims)
        self.k_proj = nn.Linear(dims, dims)
        self.v_proj = nn.Linear(dims, dims)
        self.o_proj = nn.Linear(dims, dims)

    def __call__(self, x: mx.array) -> mx.array:
        q, k, v = (split_heads(proj(x), self.heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        scale = (x.shape[-1] // self.heads) ** -0.5
        return self.o_proj(merge_heads(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)))


class EncoderBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), with LayerNorms and an unmasked attention."""

    def __init__(self, dims: int, hidden_dims: int, heads: int, eps: float, activation: str):
        super().__init__()
        self.attn_norm, self.attn = LayerNorm(dims, eps), EncoderAttention(dims, heads)
        self.ffn_norm, self.ffn = LayerNorm(dims, eps), MLP(dims, hidden_dims, activation)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class VisionEncoder(nn.Module):
    """Patch embedding -> encoder blocks -> a final LayerNorm: pixels to one vector per patch."""

    def __init__(
        self,
        dims: int,
        hidden_dims: int,
        layers: int,
        heads: int,
        image_size: int,
        patch: int,
        channels: int = 3,
        eps: float = 1e-6,
        activation: str = "gelu_pytorch_tanh",
    ):
        super().__init__()
        self.embed = PatchEmbedding(channels, dims, patch, (image_size // patch) ** 2)
        self.layers = [EncoderBlock(dims, hidden_dims, heads, eps, activation) for _ in range(layers)]
        self.norm = LayerNorm(dims, eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        x = self.embed(pixels.astype(self.embed.proj.weight.dtype))
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class PooledProjector(nn.Module):
    """Patch vectors -> `tokens` soft tokens: the square grid of patches average-pooled down to a square grid of
    `tokens`, each (1 + w)-RMS-normed and projected to the language model's width."""

    def __init__(self, dims: int, text_dims: int, patches_per_side: int, tokens: int, eps: float):
        super().__init__()
        self.side, self.tokens_side, self.tokens = patches_per_side, int(round(tokens**0.5)), tokens
        self.norm = OffsetRMSNorm(dims, eps)
        self.projection = mx.zeros((dims, text_dims))

    def __call__(self, patches: mx.array) -> mx.array:
        """(batch, side * side, dims) -> (batch, tokens, text_dims)."""
        batch, _, dims = patches.shape
        k = self.side // self.tokens_side
        grid = patches.reshape(batch, self.tokens_side, k, self.tokens_side, k, dims)
        pooled = grid.mean(axis=(2, 4)).reshape(batch, -1, dims)
        return self.norm(pooled) @ self.projection


class PixelShuffleProjector(nn.Module):
    """Patch vectors -> soft tokens: each `scale` x `scale` square of the patch grid concatenated into one vector
    (its rows in order, each row's patches in order: the pixel shuffle, space to depth), then projected to the
    language model's width without a bias. A square grid of side patches gives (side / scale) ** 2 tokens."""

    def __init__(self, dims: int, text_dims: int, scale: int):
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(dims * scale * scale, text_dims, bias=False)

    def __call__(self, patches: mx.array) -> mx.array:
        """(batch, side * side, dims) -> (batch, (side / scale) ** 2, text_dims)."""
        batch, count, dims = patches.shape
        side, s = int(round(count**0.5)), self.scale
        grid = patches.reshape(batch, side // s, s, side // s, s, dims).transpose(0, 1, 3, 2, 4, 5)
        return self.proj(grid.reshape(batch, (side // s) ** 2, s * s * dims))


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One picture as its family's image processor prepares it: `pixels` (float32, of the family's shape: a picture
    (channels, height, width), or its patches flattened) and `grid`, the facts its encoder and its places in the
    prompt follow from (a patch grid (frames, rows, columns), a tiling; empty where every image is alike)."""

    pixels: np.ndarray
    grid: tuple[int, ...] = ()

    @property
    def digest(self) -> bytes:
        """SHA-256 of the pixels and the grid: what tells this image's soft tokens from another's."""
        h = hashlib.sha256(np.ascontiguousarray(self.pixels, dtype=np.float32).tobytes())
        h.update(np.asarray(self.grid, dtype=np.int64).tobytes())
        return h.digest()


class ImageEncoder(nn.Module):
    """A family's image encoder: images (`ImageInput`s) -> their soft tokens (places, text dims), the rows of each
    image in order, as many as its config writes places for it (`image_places`); an encoder with DeepStack levels
    (Qwen3-VL's) returns (1 + levels, places, text dims), the soft tokens first (`PlacedImages.at` takes either)."""

    def __call__(self, images: Sequence[ImageInput]) -> mx.array:
        raise NotImplementedError


class FixedSizeImageEncoder(ImageEncoder):
    """A vision encoder and its projector over pictures of one size, each giving the projector's `tokens`; an image
    may be a stack of such pictures (the tiles of a tiled picture), each giving its own."""

    def __init__(self, encoder: nn.Module, projector: nn.Module):
        super().__init__()
        self.encoder, self.projector = encoder, projector

    def __call__(self, images: Sequence[ImageInput]) -> mx.array:
        """Images of (channels, height, width) or (tiles, channels, height, width) pixels -> (pictures * tokens,
        text dims), in order."""
        pixels = mx.array(np.concatenate([image.pixels.reshape(-1, *image.pixels.shape[-3:]) for image in images]))
        tokens = self.projector(self.encoder(pixels))
        return tokens.reshape(-1, tokens.shape[-1])


def image_owners(ids, image_token: int, places: Sequence[int]) -> np.ndarray:
    """Each prompt token's image number (-1 for text): image i owns the next `places[i]` places of `image_token`."""
    is_image = np.asarray(ids).reshape(-1) == image_token
    owner = np.searchsorted(np.cumsum(places), np.cumsum(is_image) - 1, side="right")
    return np.where(is_image, owner, -1)


@dataclass
class PlacedImages:
    """Soft tokens placed in a prompt: `features` (tokens, dims) replace the embeddings at `where` (their indices in
    the prompt, in order); `blocks` (where an image's tokens see each other both ways, else None) gives each prompt
    token its image's number, -1 for text. `deepstack` (levels, tokens, dims), where the encoder gives them (Qwen3-VL's
    DeepStack): level j added to the residual stream at the same places after the language model's layer j."""

    features: mx.array
    where: mx.array
    blocks: mx.array | None = None
    axes: mx.array | None = None  # (3, tokens): each prompt token's position along each axis (a multimodal RoPE)
    deepstack: mx.array | None = None
    windowed_only: bool = False  # the blocks open in sliding-window layers only; global layers read images causally
    stand_in: int | None = None  # the token an image's places read as for per-layer inputs (else the image token)

    @classmethod
    def at(
        cls,
        ids,
        image_token: int,
        features: mx.array,
        places: Sequence[int],
        both_ways: bool,
        axes=None,
        windowed_only: bool = False,
        stand_in: int | None = None,
    ) -> "PlacedImages":
        """`features` (tokens, dims) at the places of `image_token` in `ids` (one prompt's ids), image after image:
        image i takes the next `places[i]` of them (a run, or several where the family's layout breaks an image's
        places with other tokens); with `both_ways`, each image's tokens see each other both ways; `axes` (3, tokens)
        the prompt's positions along each axis where a multimodal RoPE turns them; `windowed_only`: both ways in the
        sliding-window layers alone; `stand_in`: the token the image places read as for what a model reads of the
        tokens besides their embeddings (per-layer inputs). `features` of (1 + levels, tokens, dims) (an encoder with
        DeepStack levels) are the soft tokens and those levels."""
        deepstack = None
        if features.ndim == 3:
            features, deepstack = features[0], features[1:]
        ids = np.asarray(ids).reshape(-1)
        is_image = ids == image_token
        if int(is_image.sum()) != sum(places) or features.shape[0] != sum(places):
            raise ValueError(
                f"the prompt holds {int(is_image.sum())} image places for images of {list(places)} places and "
                f"{features.shape[0]} soft tokens"
            )
        blocks = mx.array(image_owners(ids, image_token, places)) if both_ways else None
        axes = None if axes is None else mx.array(np.asarray(axes)[:, : len(ids)])
        return cls(features, mx.array(np.nonzero(is_image)[0]), blocks, axes, deepstack, windowed_only, stand_in)

    def text_ids(self, ids: mx.array) -> mx.array:
        """ids (1, tokens) with the image places as the `stand_in` token (as they are without one)."""
        if self.stand_in is None:
            return ids
        ids = mx.array(ids)
        ids[:, self.where] = self.stand_in
        return ids

    def scatter(self, x: mx.array) -> mx.array:
        """Embeddings x (1, tokens, dims) with the image tokens' replaced by the features."""
        x[:, self.where] = self.features.astype(x.dtype)[None]
        return x

    def after_layer(self, x: mx.array, layer: int) -> mx.array:
        """The residual stream x (1, tokens, dims) leaving language model layer `layer`, DeepStack's level `layer`
        added at the image tokens where there is one."""
        if self.deepstack is None or layer >= self.deepstack.shape[0]:
            return x
        x[:, self.where] = x[:, self.where] + self.deepstack[layer].astype(x.dtype)[None]
        return x
