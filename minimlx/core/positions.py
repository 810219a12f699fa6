"""What every layer of one forward pass shares: where its tokens sit, their attention masks and RoPE angles.

The loop builds one `Positions` per pass and hands it to every block, so that what depends on the positions
alone is computed once per pass instead of once per layer: the mask of each kind of cache (layers whose
caches are of one kind and window see the same columns) and the angles of each RoPE (layers whose RoPEs
have the same settings turn by the same angles).
"""

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


class Positions:
    """`tokens` new tokens from position `offset` (an int, or one position per batch row when rows are padded)."""

    def __init__(self, tokens: int, offset: int | mx.array = 0, blocks: mx.array | None = None):
        self.tokens, self.offset = tokens, offset
        self.blocks = blocks  # (tokens,) block numbers, -1 outside blocks: a block's tokens see each other both ways
        self.masks: dict = {}
        self.angle_pairs: dict = {}

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
            self.masks[kind] = mask if self.blocks is None else self.with_blocks(mask, window)
        return self.masks[kind]

    def with_blocks(self, mask, window: int | None) -> mx.array:
        """`mask` (of a first pass over an empty cache: its first keys are these tokens, any further columns empty
        room) opened within each block: a token also sees the later tokens of its own block, and within a window
        only those fewer than `window` positions before it."""
        if not isinstance(self.offset, int) or self.offset != 0:
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
