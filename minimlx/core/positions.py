"""What every layer of one forward pass shares: where its tokens sit, their attention masks and RoPE angles, the
keys and values a layer lends to later ones, and each layer's own input.

The loop builds one `Positions` per pass and hands it to every block, so that what depends on the positions
alone is computed once per pass instead of once per layer: the mask of each kind of cache (layers whose
caches are of one kind and window see the same columns) and the angles of each RoPE (layers whose RoPEs
have the same settings turn by the same angles). A layer whose keys and values later layers attend over (KV shared
across layers) lends this pass's, with the mask it saw, through `lend`; a model that gives each layer an input of its
own (per-layer input embeddings) puts them in `layer_inputs` once per pass.
"""

from dataclasses import dataclass

import mlx.core as mx

from .cache import chunk_visible, visible


def causal(tokens: int, window: int | None = None, chunk: int | None = None) -> str | mx.array | None:
    """The mask of `tokens` queries over themselves alone: causal (within `window` tokens when windowed, within
    each `chunk` of tokens when chunked), or none for a single token."""
    if chunk is not None and tokens > chunk:
        return chunk_visible(0, 0, tokens, chunk)
    if window is not None and tokens > window:
        return visible(0, 0, tokens, window)
    return "causal" if tokens > 1 else None


@dataclass(frozen=True)
class LentKV:
    """What a layer attended over in this pass, for the later layers that attend over it too: its keys and values
    (as its cache returned them), their mask, and that cache (None without one), which says how they are held."""

    keys: object
    values: object
    mask: object
    cache: object


class Positions:
    """`tokens` new tokens from position `offset` (an int, or one position per batch row when rows are padded)."""

    def __init__(self, tokens: int, offset: int | mx.array = 0, blocks: mx.array | None = None):
        self.tokens, self.offset = tokens, offset
        self.blocks = blocks  # (tokens,) block numbers, -1 outside blocks: a block's tokens see each other both ways
        self.blocks_windowed_only = False  # the blocks open in sliding-window layers only
        # (axes, tokens) positions along each axis where they are not `offset` onward along all (an image's tokens
        # under a multimodal RoPE, in a prompt's first pass)
        self.axes: mx.array | None = None
        self.masks: dict = {}
        self.angle_pairs: dict = {}
        self.lent: dict[int, LentKV] = {}
        self.layer_inputs: mx.array | None = None  # (batch, tokens, layers, features) where the model has them

    @classmethod
    def of(cls, tokens: int, cache=None) -> "Positions":
        """The positions of `tokens` tokens that continue `cache` (a layer's cache; every layer's agree)."""
        return cls(tokens, cache.position if cache is not None else 0)

    def mask(self, cache=None, window: int | None = None, chunk: int | None = None) -> str | mx.array | None:
        """The mask of this pass's queries over `cache` once they are appended (over themselves without one). Caches of
        one kind made by layers of one `window` (or `chunk`) give one mask (every layer's cache holds the same
        tokens)."""
        kind = (type(cache), window, chunk)
        if kind not in self.masks:
            mask = cache.mask(self.tokens) if cache is not None else causal(self.tokens, window, chunk)
            closed = self.blocks is None or (window is None and self.blocks_windowed_only)
            self.masks[kind] = mask if closed else self.with_blocks(mask, window)
        return self.masks[kind]

    def with_blocks(self, mask, window: int | None) -> mx.array:
        """`mask` (of a first pass over an empty cache: its first keys are these tokens, any further columns empty
        room) opened within each block: a token also sees the later tokens of its own block, and within a window
        only those fewer than `window` positions before it."""
        first = self.offset == 0 if isinstance(self.offset, int) else self.offset.size == 1 and self.offset.item() == 0
        if not first:
            raise ValueError("bidirectional blocks are read in the first pass over an empty cache only")
        here = mx.arange(self.tokens)
        base = here[None, :] <= here[:, None] if isinstance(mask, str) or mask is None else mask
        same = (self.blocks[:, None] == self.blocks[None, :]) & (self.blocks[:, None] >= 0)
        if window is not None:
            same = same & (here[:, None] - here[None, :] < window)
        room = base.shape[-1] - self.tokens
        if room:
            same = mx.concatenate([same, mx.zeros((self.tokens, room), dtype=mx.bool_)], axis=1)
        return base | same

    def lend(self, layer: int, lent: LentKV) -> None:
        """Layer `layer`'s keys and values of this pass, for the later layers that attend over them."""
        self.lent[layer] = lent

    def borrowed(self, layer: int) -> LentKV:
        """What layer `layer` lent in this pass (it runs before the layers that borrow it)."""
        if layer not in self.lent:
            raise ValueError(f"layer {layer} lent no keys and values in this pass; it must run before its borrowers")
        return self.lent[layer]

    def layer_input(self, layer: int) -> mx.array:
        """Layer `layer`'s own input, (batch, tokens, features)."""
        return self.layer_inputs[:, :, layer]

    def indices(self) -> mx.array:
        """Each new token's position: (tokens,), or (batch, tokens) for a position per row."""
        start = self.offset
        if isinstance(start, mx.array) and start.size > 1:
            return start[:, None] + mx.arange(self.tokens)
        return start + mx.arange(self.tokens)

    def angles(self, rope) -> tuple[mx.array, mx.array]:
        """cos and sin of `rope`'s angles at these positions (see `RoPE.angles`)."""
        if rope.settings not in self.angle_pairs:
            self.angle_pairs[rope.settings] = rope.angles(self.offset, self.tokens)
        return self.angle_pairs[rope.settings]
