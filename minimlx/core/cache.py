"""Caches that let decoding reuse the keys and values of earlier tokens.

Every cache follows one protocol: `update(...)` appends this step's entries and returns
everything cached so far, `offset` is the number of cached tokens, `trim(n)` forgets the last
n tokens, `nbytes` is the memory held.
"""

import mlx.core as mx


class GrowingBuffer:
    """Arrays of shape (..., tokens, features) preallocated in steps, so appending is a slice write."""

    step = 256

    def __init__(self):
        self.arrays: list[mx.array] | None = None
        self.offset = 0

    def append(self, *new: mx.array) -> list[mx.array]:
        previous, count = self.offset, new[0].shape[-2]
        if self.arrays is None or previous + count > self.arrays[0].shape[-2]:
            grow = (count + self.step - 1) // self.step * self.step
            fresh = [mx.zeros((*a.shape[:-2], grow, a.shape[-1]), dtype=a.dtype) for a in new]
            if self.arrays is None:
                self.arrays = fresh
            else:
                self.arrays = [mx.concatenate([old[..., :previous, :], f], axis=-2) for old, f in zip(self.arrays, fresh)]
        self.offset += count
        for buffer, a in zip(self.arrays, new):
            buffer[..., previous : self.offset, :] = a
        return [buffer[..., : self.offset, :] for buffer in self.arrays]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) if self.arrays else 0

    @property
    def state(self) -> list[mx.array]:
        return self.arrays or []


class KVCache(GrowingBuffer):
    """Keys and values of shape (batch, kv_heads, tokens, head_dim) for one attention layer."""

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        keys, values = self.append(keys, values)
        return keys, values


class LatentCache(GrowingBuffer):
    """Latent attention's cache, (batch, 1, tokens, latent_dims + rope_dims) for one layer.

    Per token it keeps the normed key/value latent and the rotated key part shared by all heads,
    side by side: what the keys and values of every head are recomputed from.
    """

    def update(self, latent_keys: mx.array) -> mx.array:
        return self.append(latent_keys)[0]
