"""Caches that let decoding reuse the keys and values of earlier tokens.

Every cache follows one protocol: `update(...)` appends this step's entries and returns
everything the step attends over, `offset` is the number of tokens seen, `trim(n)` forgets the
last n tokens (`keeps(count)` says whether the first `count` can still be had back: a
sliding-window cache drops old ones), `nbytes` is the memory held.

A cache may hold several sequences of different lengths, one per batch row, each left-padded to
the longest (`padding`: how many leading columns of each row hold no token). Attention learns about
this only through the protocol: `position` (where each row's next token sits in its own sequence,
for RoPE) and `mask(tokens)` (which cached columns each query may see). `merge` and `select` build
such caches from others and take rows out of them, which is how sequences join and leave a batch.
`FixedKVCache` holds one sequence in buffers of a fixed capacity, written at an array position: what a compiled
decode step replays over.

The protocol is `Cache`. What a kind can do is declared on its class as `capabilities` (a `Can` flag set), and
whoever reuses, shortens or batches caches asks `cache.can(...)`, never the class: a kind whose state is a function
of the whole prefix (a recurrent layer's) declares no `CUT`, and is reused whole through `snapshot`/`restore`.
"""

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx
import numpy as np


class Can(enum.Flag):
    """What a cache kind can do (`Cache.capabilities`)."""

    SNAPSHOT = enum.auto()
    """`snapshot()` copies the whole state and `restore()` puts it back (every kind)."""
    CUT = enum.auto()
    """Per-token entries: `trim` and `prefix` go back to any count `keeps` allows (every count up to `offset`, unless
    `WINDOW`). A kind without it keeps only all its tokens or none."""
    ROWS = enum.auto()
    """Several sequences as left-padded rows: `merge` joins caches, `select` takes rows out (batching). A kind without
    it holds one sequence."""
    WINDOW = enum.auto()
    """Bounded memory: drops old tokens, after which `keeps` refuses to go back before them."""
    SINKS = enum.auto()
    """Keeps the text's first tokens (attention sinks) beside the window."""
    QUANTIZED = enum.auto()
    """Entries held as `Quantized` (codes, scales, biases) triples, which `update` returns."""
    BUFFERS = enum.auto()
    """Keys and values in `buffers` that an op writes one token into at `start` (`reserve`, then `written`): the
    compiled step and the native `block_step`."""
    SHARED = enum.auto()
    """Holds no entries of its own: the layer attends over another layer's cache (`SharedKVCache`), so that cache's
    bounds are its bounds."""
    FIXED = enum.auto()
    """A fixed capacity written at an array position (`FixedKVCache`): what the compiled step replays over. It stands
    for the growing kind `saved_as` names."""


@dataclass(frozen=True)
class Snapshot:
    """A cache's whole state: the arrays of the columns it holds (as a prompt cache file keeps them), the tokens seen,
    and each row's padding. Taking one leaves the cache as it is; restoring one leaves the snapshot as it is."""

    arrays: list[mx.array]
    offset: int
    padding: list[int] = field(default_factory=list)
    shifts: list[int] = field(default_factory=list)
    """Per row, how many positions further on than its count the next token sits (`Cache.shift_positions`)."""
    shifted_at: int = 0
    marks: list[dict[int, list[mx.array]]] = field(default_factory=list)
    """A kind that cannot be cut: per row, its states at earlier token counts (`Cache.mark`), by count."""

    def held(self) -> list[mx.array]:
        """Every array it holds, its marks' included (to evaluate them all)."""
        return self.arrays + [a for row in self.marks for arrays in row.values() for a in arrays]


class Cache(ABC):
    """One layer's memory of the tokens seen so far: the protocol every cache kind follows.

    `update(...)` adds a step's entries and returns what the step attends over; `offset` counts the tokens seen;
    `position` and `mask(tokens)` are what attention reads of them; `nbytes` and `state` are the memory held and the
    arrays to evaluate. `snapshot()`/`restore()` copy the whole state out and back (every kind). `keeps(count)` says
    whether the first `count` tokens can be had back (`trim` to them, or `prefix` a new cache of them): any count
    for a kind that can be `CUT` (until a `WINDOW` drops them), else only all or none. `select`/`merge` take rows out
    of a batch and join caches into one (`ROWS`; else a single sequence only).
    """

    capabilities: ClassVar[Can] = Can.SNAPSHOT
    holds_positions: ClassVar[bool] = True  # whether its tokens' positions (and their shift) are its to say
    offset: int

    def can(self, capability: Can) -> bool:
        """Whether this kind declares `capability` (every one of several)."""
        return capability in self.capabilities

    @abstractmethod
    def update(self, *entries: mx.array):
        """Add this step's entries; return everything the step attends over."""

    @property
    @abstractmethod
    def position(self) -> int | mx.array:
        """Where the next token sits in its own sequence (one per row when rows are padded)."""

    @abstractmethod
    def mask(self, tokens: int) -> str | mx.array | None:
        """The attention mask of `tokens` new queries over the cache once they are added."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """The bytes held."""

    @property
    @abstractmethod
    def state(self) -> list[mx.array]:
        """The arrays to evaluate for the cache to be computed."""

    @abstractmethod
    def empty(self) -> "Cache":
        """A new cache of this kind (same settings), holding nothing."""

    @abstractmethod
    def snapshot(self) -> Snapshot:
        """The whole state, as arrays that later updates of this cache leave as they are."""

    @abstractmethod
    def restore(self, snapshot: Snapshot) -> None:
        """Hold `snapshot` (taken from a cache of this kind, or of the kind it is `saved_as`)."""

    def settings(self) -> dict:
        """What the kind is made with besides its tokens (a window, sinks, bits), as a prompt cache file records it."""
        return {}

    @classmethod
    def saved_as(cls) -> type:
        """The kind whose entries this one holds, as a prompt cache file names it: this one, or the growing kind a
        fixed cache stands for."""
        return cls

    def copy(self) -> "Cache":
        """A new cache holding what this one holds; updating either leaves the other as it is."""
        fresh = self.empty()
        fresh.restore(self.snapshot())
        return fresh

    def keeps(self, count: int) -> bool:
        """Whether the first `count` tokens can be had back (by `trim` or `prefix`): all or none of them, for a kind
        that cannot be cut."""
        return count in (0, self.offset)

    def latest_kept(self, count: int) -> int:
        """The most first tokens, `count` at most, that can be had back (`keeps`): 0 when none can."""
        return count if self.keeps(count) else 0

    def mark(self) -> None:
        """Remember the state at the tokens seen so far, so that `keeps`, `trim` and `prefix` can go back to it later:
        nothing to do for a kind that can be `CUT` (whoever feeds a prompt marks every chunk's end)."""
        return None

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (at most `offset`); return how many were forgotten."""
        n = min(self.offset, n)
        if not self.keeps(self.offset - n):
            raise ValueError(f"a {type(self).__name__} of {self.offset} tokens cannot go back to {self.offset - n}")
        if n:
            self.restore(self.empty().snapshot())
        return n

    def prefix(self, count: int) -> "Cache":
        """A new cache of the first `count` tokens (of one unpadded row); appending to it leaves this one as it is."""
        if not self.keeps(count):
            raise ValueError(f"a {type(self).__name__} of {self.offset} tokens cannot give its first {count}")
        return self.copy() if count else self.empty()

    def rows(self) -> int:
        return 1

    def row_padding(self) -> list[int]:
        return [0] * self.rows()

    def shift_positions(self, shift: int) -> None:
        """From the next token on, this one sequence's tokens sit `shift` positions further on than their count (a
        multimodal RoPE gives an image's tokens fewer positions than places): `position` says so, and a `prefix`
        that keeps the tokens before now keeps no shift."""
        raise ValueError(f"a {type(self).__name__} cannot shift its positions; use a plain KV cache")

    def select(self, rows: list[int]) -> "Cache":
        """A cache of these rows only (a kind without `ROWS` holds one)."""
        if rows != [0]:
            raise ValueError(f"a {type(self).__name__} holds one sequence; rows {rows} were asked for")
        return self

    @classmethod
    def merge(cls, caches: list["Cache"]) -> "Cache":
        """One cache holding the rows of `caches` (a kind without `ROWS` takes one)."""
        if len(caches) != 1:
            raise ValueError(f"a {cls.__name__} holds one sequence; {len(caches)} were to be merged")
        return caches[0]


class GrowingBuffer(Cache):
    """Arrays of shape (batch, ..., tokens, features) preallocated in steps, so appending is a slice write."""

    capabilities = Can.SNAPSHOT | Can.CUT | Can.ROWS
    step = 256
    # Free columns a merged cache starts with: a join copies every row into fresh memory (page faults included),
    # so a merge leaves less room than a fresh buffer and grows again when it fills.
    merge_room = 64

    def __init__(self):
        self.arrays: list[mx.array] | None = None
        self.offset = 0
        self.padding: list[int] = []  # per row; empty means no row is padded
        self.shifts: list[int] = []  # per row (`shift_positions`); empty means no row is shifted
        self.shifted_at = 0  # the tokens one row had when it was shifted

    def append(self, *new: mx.array) -> list[mx.array]:
        previous, count = self.offset, new[0].shape[-2]
        if self.arrays is None:
            self.arrays = [mx.zeros((*a.shape[:-2], self.room(count), a.shape[-1]), dtype=a.dtype) for a in new]
        self.reserve(count)
        self.offset += count
        for buffer, a in zip(self.arrays, new):
            buffer[..., previous : self.offset, :] = a
        return [buffer[..., : self.offset, :] for buffer in self.arrays]

    def room(self, count: int) -> int:
        """The columns a growth by `count` tokens adds: whole steps."""
        return (count + self.step - 1) // self.step * self.step

    def reserve(self, count: int) -> None:
        """Grow the buffers (once they exist) so that `count` more tokens fit."""
        if self.arrays is not None and self.offset + count > self.arrays[0].shape[-2]:
            grow = self.room(count)
            self.arrays = [
                mx.concatenate(
                    [a[..., : self.offset, :], mx.zeros((*a.shape[:-2], grow, a.shape[-1]), a.dtype)], axis=-2
                )
                for a in self.arrays
            ]

    @property
    def buffers(self) -> list[mx.array] | None:
        """The arrays the entries are written into (of a fixed capacity until `reserve` grows them; None before the
        first update)."""
        return self.arrays

    @property
    def start(self) -> mx.array:
        """`offset` as an array of one: where the next token goes."""
        return mx.array([self.offset])

    def written(self, buffers: list[mx.array], tokens: int) -> None:
        """Hold the buffers with `tokens` more tokens' entries written at `offset` (by an op that writes them as it
        computes a layer's step), and move past them."""
        self.arrays = buffers
        self.offset += tokens

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        if self.offset < self.shifted_at:
            self.shifts = []
        return n

    def keeps(self, count: int) -> bool:
        """Whether the first `count` tokens can still be had back (by `trim` or `prefix`)."""
        return count <= self.offset

    def shift_positions(self, shift: int) -> None:
        self.shifts, self.shifted_at = [shift], self.offset

    def row_shifts(self) -> list[int]:
        return self.shifts or [0] * self.rows()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) if self.arrays else 0

    @property
    def state(self) -> list[mx.array]:
        return self.arrays or []

    def held_columns(self) -> list[mx.array]:
        """The arrays' columns that hold tokens."""
        return [a[..., : self.offset, :] for a in self.arrays] if self.arrays is not None else []

    def snapshot(self) -> Snapshot:
        return Snapshot(self.held_columns(), self.offset, list(self.padding), list(self.shifts), self.shifted_at)

    def restore(self, snapshot: Snapshot) -> None:
        # views of the snapshot's arrays: writing into them (`append`) leaves the snapshot's own as they are
        self.arrays = [a[..., : a.shape[-2], :] for a in snapshot.arrays] or None
        self.offset, self.padding = snapshot.offset, list(snapshot.padding)
        self.shifts, self.shifted_at = list(snapshot.shifts), snapshot.shifted_at

    @property
    def position(self) -> int | mx.array:
        """Position of the next token in its own sequence: `offset`, or one per row (batch,) when rows are padded or
        shifted."""
        if any(self.shifts):
            return row_positions(self.offset, self.row_padding()) + mx.array(self.row_shifts())
        return row_positions(self.offset, self.padding) if any(self.padding) else self.offset

    def mask(self, tokens: int) -> str | mx.array | None:
        """The attention mask for `tokens` new queries over the cache once they are appended: causal,
        and, when rows are padded, a boolean (batch, 1, tokens, keys) array that also hides the padding."""
        if not any(self.padding):
            return "causal" if tokens > 1 else None
        if tokens > 1:
            return visible(0, self.offset, tokens, padding=self.padding)
        return decode_mask(self.offset, self.padding)

    def rows(self) -> int:
        return self.arrays[0].shape[0] if self.arrays is not None else 1

    def row_padding(self) -> list[int]:
        return self.padding or [0] * self.rows()

    def select(self, rows: list[int]) -> "GrowingBuffer":
        """A cache of these rows only (self when that is all of it), without the leading columns none of them uses."""
        everything = rows == list(range(self.rows()))
        padding = [self.row_padding()[r] for r in rows]
        drop = min(padding)
        if everything and drop == 0:
            return self
        picked = self.empty()
        picked.offset, picked.padding = self.offset - drop, [p - drop for p in padding]
        picked.shifts = [self.row_shifts()[r] for r in rows] if any(self.shifts) else []
        picked.shifted_at = max(self.shifted_at - drop, 0)
        picked.arrays = [self.kept_columns(a if everything else a[mx.array(rows)], drop) for a in self.arrays]
        return picked

    def empty(self) -> "GrowingBuffer":
        """A new cache of this kind, holding nothing."""
        return type(self)()

    def kept_columns(self, a: mx.array, drop: int) -> mx.array:
        """The columns of `a` a selection keeps when its first `drop` columns are padding in every row."""
        return a[..., drop:, :]

    def prefix(self, count: int) -> "GrowingBuffer":
        """A new cache of the first `count` tokens of this one (which holds one unpadded row); appending to it
        leaves this one as it is."""
        fresh = self.empty()
        fresh.arrays, fresh.offset = [a[..., :count, :] for a in self.arrays], count
        if count >= self.shifted_at:
            fresh.shifts, fresh.shifted_at = list(self.shifts), self.shifted_at
        return fresh

    @classmethod
    def merge(cls, caches: list["GrowingBuffer"]) -> "GrowingBuffer":
        """One cache holding the rows of `caches` one after another, each left-padded to the longest.

        An empty cache (a sequence with nothing cached yet) counts as one row of padding only.
        """
        filled = [c for c in caches if c.arrays is not None]
        if len(caches) == 1 or not filled:
            return caches[0] if len(caches) == 1 else caches[0].empty()
        offset = max(c.offset for c in caches)
        capacity = offset + cls.merge_room
        merged, parts = caches[0].empty(), []
        for c in caches:
            shift = offset - c.offset
            merged.padding += [p + shift for p in c.row_padding()]
            merged.shifts += c.row_shifts()
            if c.arrays is None:
                parts.append([mx.zeros((1, *a.shape[1:-2], capacity, a.shape[-1]), a.dtype) for a in filled[0].arrays])
            else:
                parts.append([pad(a[..., : c.offset, :], shift, capacity - offset) for a in c.arrays])
        merged.offset, merged.arrays = offset, [mx.concatenate(rows, axis=0) for rows in zip(*parts)]
        merged.shifts = merged.shifts if any(merged.shifts) else []
        return merged


def row_positions(offset: int, padding: list[int]) -> mx.array:
    """(batch,) where each row's next token sits in its own sequence."""
    return mx.array([offset - p for p in padding])


def decode_mask(offset: int, padding: list[int]) -> mx.array:
    """(batch, 1, 1, offset + 1): the columns one new token per row sees once appended, its row's padding hidden."""
    return mx.array(np.arange(offset + 1)[None, None, None, :] >= np.array(padding)[:, None, None, None])


def pad(a: mx.array, before: int, after: int) -> mx.array:
    """Zeros on both sides of the token axis (-2)."""
    return mx.pad(a, [(0, 0)] * (a.ndim - 2) + [(before, after), (0, 0)])


class KVCache(GrowingBuffer):
    """Keys and values of shape (batch, kv_heads, tokens, head_dim) for one attention layer."""

    capabilities = GrowingBuffer.capabilities | Can.BUFFERS

    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        keys, values = self.append(keys, values)
        return keys, values


class Quantized:
    """Keys and values held as `mx.quantize` holds weights: per group of `group_size` features of a row, codes of
    `bits` bits and a float scale and bias (value = scale * code + bias). At 8 bits a float32 cache takes 0.28 of its
    bytes (codes plus a scale and bias per 64 features), at 4 bits 0.16, and attention reads that much less memory
    per step (`quantized_attention`). Attention gets keys and values as (codes, scales, biases) triples, each of shape
    (batch, kv_heads, tokens, ...). The groups are 64 features where that divides the head size, else 32 (set by the
    first update)."""

    def __init__(self, bits: int = 8, group_size: int | None = None):
        super().__init__()
        self.bits, self.group_size = bits, group_size

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self.group_size is None:
            self.group_size = 64 if x.shape[-1] % 64 == 0 else 32
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def dequantize(self, triple: tuple[mx.array, ...]) -> mx.array:
        """The float keys or values a triple `update` returned holds."""
        return mx.dequantize(*triple, group_size=self.group_size, bits=self.bits)

    def settings(self) -> dict:
        return {"bits": self.bits}


class QuantizedKVCache(Quantized, KVCache):
    """A growing cache of `Quantized` keys and values."""

    capabilities = KVCache.capabilities | Can.QUANTIZED

    def update(self, keys: mx.array, values: mx.array) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        arrays = self.append(*self.quantize(keys), *self.quantize(values))
        return tuple(arrays[:3]), tuple(arrays[3:])

    def empty(self) -> "QuantizedKVCache":
        return QuantizedKVCache(self.bits, self.group_size)


def quantized_cache(cache, bits: int | None):
    """`cache` with its keys and values held in `bits` bits (a `QuantizedKVCache`, or for the compiled step's fixed
    cache a `FixedQuantizedKVCache`) where it is a plain, empty KV cache; else `cache` itself (sliding windows and
    latent caches stay as they are)."""
    if bits is None:
        return cache
    if type(cache) is KVCache and cache.arrays is None:
        return QuantizedKVCache(bits)
    if type(cache) is FixedKVCache and cache.keys is None:
        return FixedQuantizedKVCache(bits)
    return cache


class LatentCache(GrowingBuffer):
    """Latent attention's cache, (batch, 1, tokens, latent_dims + rope_dims) for one layer.

    Per token it keeps the normed key/value latent and the rotated key part shared by all heads,
    side by side: what the keys and values of every head are recomputed from.
    """

    def update(self, latent_keys: mx.array) -> mx.array:
        return self.append(latent_keys)[0]


class IndexedLatentCache(GrowingBuffer):
    """A `LatentCache` with a sparse attention indexer's keys beside the latents, (batch, 1, tokens, index_dims)."""

    def update(self, latent_keys: mx.array, index_keys: mx.array) -> tuple[mx.array, mx.array]:
        return tuple(self.append(latent_keys, index_keys))


class SharedKVCache(Cache):
    """The cache of a layer that attends over an earlier layer's keys and values (KV shared across layers): the
    earlier layer's cache holds them and lends each pass's to this layer (`Positions.lend`), so this one holds no
    entries, only the tokens seen and each row's padding, which batching, trimming and snapshots keep in step with
    the other layers'."""

    capabilities = Can.SNAPSHOT | Can.CUT | Can.ROWS | Can.SHARED

    def __init__(self):
        self.offset = 0
        self.padding: list[int] = []  # per row; empty means no row is padded
        self.row_count = 1

    def update(self, tokens: int) -> None:
        """Count `tokens` more tokens seen (their keys and values are the lending layer's)."""
        self.offset += tokens

    @property
    def position(self) -> int | mx.array:
        return row_positions(self.offset, self.padding) if any(self.padding) else self.offset

    def mask(self, tokens: int) -> str | mx.array | None:
        return "causal" if tokens > 1 else None  # unused: the lending layer's mask comes with its keys and values

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def state(self) -> list[mx.array]:
        return []

    def empty(self) -> "SharedKVCache":
        return SharedKVCache()

    def snapshot(self) -> Snapshot:
        return Snapshot([], self.offset, list(self.padding))

    def restore(self, snapshot: Snapshot) -> None:
        self.offset, self.padding = snapshot.offset, list(snapshot.padding)
        self.row_count = max(len(self.padding), 1)

    def keeps(self, count: int) -> bool:
        return count <= self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def prefix(self, count: int) -> "SharedKVCache":
        fresh = SharedKVCache()
        fresh.offset = count
        return fresh

    def rows(self) -> int:
        return self.row_count

    def select(self, rows: list[int]) -> "SharedKVCache":
        padding = [self.row_padding()[r] for r in rows]
        picked = SharedKVCache()
        drop = min(padding)
        picked.offset, picked.padding, picked.row_count = self.offset - drop, [p - drop for p in padding], len(rows)
        return picked

    def row_padding(self) -> list[int]:
        return self.padding or [0] * self.rows()

    @classmethod
    def merge(cls, caches: list["SharedKVCache"]) -> "SharedKVCache":
        if len(caches) == 1:
            return caches[0]
        merged = SharedKVCache()
        merged.offset = max(c.offset for c in caches)
        for c in caches:
            merged.padding += [p + merged.offset - c.offset for p in c.row_padding()]
        merged.row_count = len(merged.padding)
        return merged


def visible(
    start: int, offset: int, tokens: int, window: int | None = None, padding: list[int] = (), sinks: int = 0
) -> mx.array:
    """Which keys each new query may see, as a boolean (tokens, keys) array, or (batch, 1, tokens, keys) with
    `padding`: keys at positions start..offset+tokens-1 (counted like the cache's columns, padding included),
    queries at offset..offset+tokens-1. A query sees keys not after itself, fewer than `window` positions back
    when windowed, and not its row's padding. A query that is itself padding (a shorter prompt in a batched
    prefill) sees only itself, so that its output, which nothing reads, stays finite.

    With `sinks`, the keys are positions 0..sinks-1 followed by start..offset+tokens-1 (start >= sinks), and a
    query sees the first `sinks` positions and, of the others, those fewer than `window - sinks` positions back."""
    keys = mx.arange(start, offset + tokens)
    if sinks:
        keys = mx.concatenate([mx.arange(sinks), keys])
    queries = mx.arange(offset, offset + tokens)[:, None]
    seen = keys <= queries
    if window is not None:
        seen = seen & ((keys > queries - window + sinks) | (keys < sinks))
    if any(padding):
        seen = seen & (keys[None, None, None, :] >= mx.array(padding)[:, None, None, None]) | (keys == queries)
    return seen


class RotatingKVCache(KVCache):
    """Keys and values of a sliding-window attention layer: a token sees itself and the `window - 1` tokens
    before it, so only the last `window - 1` are kept and memory stays the same however long the text.

    `offset`, `padding` and `position` mean what they mean for any cache (tokens seen, counting the left
    padding of shorter rows); the arrays hold the last `held` of those columns. `update` returns the kept
    columns followed by the new ones, so a prefill chunk longer than the window still sees, for each of its
    tokens, exactly its window (`mask` hides the rest). The first `count` tokens can be recovered (`trim`,
    `prefix`) only while nothing has been dropped, or for `count` equal to `offset` (see `keeps`).
    """

    capabilities = GrowingBuffer.capabilities | Can.WINDOW

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def settings(self) -> dict:
        return {"window": self.window}

    @property
    def held(self) -> int:
        return self.arrays[0].shape[-2] if self.arrays is not None else 0

    def held_columns(self) -> list[mx.array]:
        return list(self.arrays) if self.arrays is not None else []

    def append(self, *new: mx.array) -> list[mx.array]:
        seen = new if self.arrays is None else [mx.concatenate([old, a], axis=-2) for old, a in zip(self.arrays, new)]
        self.offset += new[0].shape[-2]
        keep = min(self.offset, self.window - 1)
        self.arrays = [a[..., a.shape[-2] - keep :, :] for a in seen]
        if new[0].shape[-2] > 1:  # after a prefill chunk, hold a copy of the window, not a view of the whole chunk
            self.arrays = [mx.contiguous(a) for a in self.arrays]
        return list(seen)

    def mask(self, tokens: int) -> str | mx.array | None:
        if not any(self.padding) and self.held + tokens <= self.window:
            return "causal" if tokens > 1 else None
        return visible(self.offset - self.held, self.offset, tokens, self.window, self.padding)

    def keeps(self, count: int) -> bool:
        return count == 0 or count == self.offset or (count < self.offset and self.held == self.offset)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        count = self.offset - n
        if not self.keeps(count):
            raise ValueError(f"a sliding-window cache of {self.offset} tokens no longer holds the first {count}")
        self.arrays = [a[..., : self.held - n, :] for a in self.arrays] if count else None
        self.offset, self.padding = count, self.padding if count else []
        self.shifts = self.shifts if count >= self.shifted_at else []
        return n

    def prefix(self, count: int) -> "RotatingKVCache":
        if not self.keeps(count):
            raise ValueError(f"a sliding-window cache of {self.offset} tokens no longer holds the first {count}")
        fresh = self.empty()
        if count:
            fresh.arrays, fresh.offset = [a[..., : count - (self.offset - self.held), :] for a in self.arrays], count
        if count >= self.shifted_at:
            fresh.shifts, fresh.shifted_at = list(self.shifts), self.shifted_at
        return fresh

    def empty(self) -> "RotatingKVCache":
        return RotatingKVCache(self.window)

    def kept_columns(self, a: mx.array, drop: int) -> mx.array:
        keep = min(self.offset - drop, self.window - 1)
        return a[..., a.shape[-2] - keep :, :]

    @classmethod
    def merge(cls, caches: list["RotatingKVCache"]) -> "RotatingKVCache":
        window = caches[0].window
        filled = [c for c in caches if c.arrays is not None]
        if len(caches) == 1 or not filled:
            return caches[0] if len(caches) == 1 else caches[0].empty()
        merged = caches[0].empty()
        merged.offset = max(c.offset for c in caches)
        keep, parts = min(merged.offset, window - 1), []
        for c in caches:
            shift = merged.offset - c.offset
            merged.padding += [p + shift for p in c.row_padding()]
            merged.shifts += c.row_shifts()
            if c.arrays is None:
                parts.append([mx.zeros((1, *a.shape[1:-2], keep, a.shape[-1]), a.dtype) for a in filled[0].arrays])
            else:
                parts.append([pad(a, keep - a.shape[-2], 0) for a in c.arrays])
        merged.arrays = [mx.concatenate(rows, axis=0) for rows in zip(*parts)]
        merged.shifts = merged.shifts if any(merged.shifts) else []
        return merged


def chunk_visible(start: int, offset: int, tokens: int, chunk: int, padding: list[int] = ()) -> mx.array:
    """Which keys each new query may see under chunked attention, as `visible` gives it (same arguments and shapes):
    keys not after the query and in its own chunk (positions `c * chunk` to `(c + 1) * chunk - 1` of its row's
    sequence), not its row's padding; a query that is padding sees only itself."""
    keys = mx.arange(start, offset + tokens)
    queries = mx.arange(offset, offset + tokens)[:, None]
    if not any(padding):
        return (keys <= queries) & (keys // chunk == queries // chunk)
    shift = mx.array(padding)[:, None, None, None]
    own_keys, own_queries = keys - shift, queries - shift
    same = (own_keys >= 0) & (own_keys // chunk == own_queries // chunk)
    return ((keys <= queries) & same) | (keys == queries)


class ChunkedKVCache(RotatingKVCache):
    """Keys and values of a chunked-attention layer: the text is cut into chunks of `chunk` tokens and a token sees
    the tokens before it in its own chunk only, so at most the `chunk - 1` tokens before the next one are kept (the
    current chunk's, and those of a padded row's own chunk: rows hold the same columns, each masked by its own
    chunk). Trimming, batching and snapshots are the sliding window's; only what a query sees differs."""

    def __init__(self, chunk: int):
        super().__init__(chunk)
        self.chunk = chunk

    def settings(self) -> dict:
        return {"chunk": self.chunk}

    def mask(self, tokens: int) -> str | mx.array | None:
        start = self.offset - self.held
        if not any(self.padding) and start // self.chunk == (self.offset + tokens - 1) // self.chunk:
            return "causal" if tokens > 1 else None
        return chunk_visible(start, self.offset, tokens, self.chunk, self.padding)

    def empty(self) -> "ChunkedKVCache":
        return ChunkedKVCache(self.chunk)


SINKS = 4
"""The first tokens a bounded cache keeps (as mlx-lm's `RotatingKVCache(keep=4)` and StreamingLLM do)."""


class SinkKVCache(RotatingKVCache):
    """Keys and values of at most `window` tokens: the first `sinks` of the text and the most recent others, so
    that an endless text stays in bounded memory (`max_kv_size`). A token sees the first `sinks` tokens (the
    attention sinks of StreamingLLM, Xiao et al. 2023: attention that has nowhere better to go lands on them, and
    without them the text falls apart once they leave) and the `window - sinks - 1` tokens before it.

    The arrays hold the first `sinks` columns, then the last `held - sinks`; until the text outgrows the window,
    that is all of it, and attention is the plain cache's. It holds one sequence: batches of different lengths
    would not share their first columns.
    """

    capabilities = Can.SNAPSHOT | Can.CUT | Can.WINDOW | Can.SINKS

    def __init__(self, window: int, sinks: int = SINKS):
        super().__init__(window)
        self.sinks = sinks

    def settings(self) -> dict:
        return {"window": self.window, "sinks": self.sinks}

    def append(self, *new: mx.array) -> list[mx.array]:
        seen = new if self.arrays is None else [mx.concatenate([old, a], axis=-2) for old, a in zip(self.arrays, new)]
        self.offset += new[0].shape[-2]
        keep = min(self.offset, self.window - 1)
        self.arrays = [
            a
            if a.shape[-2] == keep
            else mx.concatenate([a[..., : self.sinks, :], a[..., a.shape[-2] - keep + self.sinks :, :]], axis=-2)
            for a in seen
        ]
        if new[0].shape[-2] > 1:  # after a prefill chunk, hold a copy of the window, not a view of the whole chunk
            self.arrays = [mx.contiguous(a) for a in self.arrays]
        return list(seen)

    def mask(self, tokens: int) -> str | mx.array | None:
        if self.held + tokens <= self.window:
            return "causal" if tokens > 1 else None
        return visible(self.offset - self.held + self.sinks, self.offset, tokens, self.window, sinks=self.sinks)

    def empty(self) -> "SinkKVCache":
        return SinkKVCache(self.window, self.sinks)

    @classmethod
    def merge(cls, caches: list["SinkKVCache"]) -> "SinkKVCache":
        if len(caches) != 1:
            raise ValueError(f"a cache with attention sinks holds one sequence; {len(caches)} were to be merged")
        return caches[0]


def sink_cache(cache, size: int | None):
    """`cache` bounded to `size` tokens (a `SinkKVCache`) where it is a plain, empty KV cache and `size` is given;
    else `cache` itself (sliding windows are bounded already)."""
    return SinkKVCache(size) if size is not None and type(cache) is KVCache and cache.arrays is None else cache


class FixedKVCache(Cache):
    """Keys and values (1, kv_heads, capacity, head_dim) of one sequence, written at an array position.

    What a compiled decode step needs: the forward pass reads only arrays (`start`, the buffers) and shapes
    from it, so `mx.compile` traces a step once per capacity and replays it for every token. A one-token step's
    attention reads the whole capacity, the mask hiding the columns past the last token (so trimming only moves
    `offset` and `start` back); longer calls (prompts, speculative checks) run eagerly over the filled columns
    alone. The capacity grows by `step` tokens when an update would not fit (the compiled step then retraces
    once).
    """

    capabilities = Can.SNAPSHOT | Can.CUT | Can.BUFFERS | Can.FIXED
    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.start = mx.array([0])  # `offset` as an array of one: where the next token goes
        self.shift = mx.array([0])  # how many positions further on the next token sits (`shift_positions`)
        self.shifted_at = 0

    @classmethod
    def over(
        cls, keys: mx.array, values: mx.array, offset: int, start: mx.array, shift: mx.array | None = None
    ) -> "FixedKVCache":
        """A cache over buffers (1, kv_heads, capacity, head_dim) whose first `offset` columns hold tokens (`start`:
        `offset` as an array, which the layers of a step share; `shift` its positions' shift)."""
        cache = cls()
        cache.keys, cache.values, cache.offset, cache.start = keys, values, offset, start
        cache.shift = cache.shift if shift is None else shift
        return cache

    def shift_positions(self, shift: int) -> None:
        self.shift, self.shifted_at = mx.array([shift]), self.offset

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.keys is not None else 0

    def capacity_for(self, tokens: int) -> int:
        """The capacity once `tokens` more are written: the current one if they fit, else the next multiple
        of `step`."""
        capacity = self.capacity
        needed = self.offset + tokens
        return capacity if needed <= capacity else (needed + self.step - 1) // self.step * self.step

    def reserve(self, tokens: int) -> None:
        """Grow the buffers (once they exist) so that `tokens` more fit."""
        capacity = self.capacity_for(tokens)
        if self.keys is not None and capacity > self.capacity:
            self.hold([pad(a, 0, capacity - a.shape[2]) for a in self.buffers])

    def update(self, keys: mx.array, values: mx.array):
        tokens = keys.shape[2]
        entries = self.entries(keys, values)
        if self.keys is None:
            capacity = self.capacity_for(tokens)
            self.hold([mx.zeros((*a.shape[:2], capacity, a.shape[3]), a.dtype) for a in entries])
        self.reserve(tokens)
        self.written([mx.slice_update(b, a, self.start, axes=(2,)) for b, a in zip(self.buffers, entries)], tokens)
        if tokens > 1:
            return self.pair([a[..., : self.offset, :] for a in self.buffers])
        return self.keys, self.values

    def entries(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """What a step writes into the buffers (as `buffers` lists them) for these keys and values."""
        return [keys, values]

    def pair(self, buffers: list[mx.array]) -> tuple:
        """(keys, values) of arrays laid out as `buffers` lists them."""
        return buffers[0], buffers[1]

    @property
    def buffers(self) -> list[mx.array] | None:
        """The arrays the keys and values are written into (None before the first update)."""
        return [self.keys, self.values] if self.keys is not None else None

    def hold(self, buffers: list[mx.array]) -> None:
        """Hold `buffers` (as `buffers` lists them) as the keys and values."""
        self.keys, self.values = self.pair(buffers)

    def written(self, buffers: list[mx.array], tokens: int) -> None:
        """Hold the buffers with `tokens` more tokens' keys and values written at `start` (by `update`, or by an op
        that writes them as it computes a layer's step), and move past them."""
        self.hold(buffers)
        self.start = self.start + tokens
        self.offset += tokens

    def take(self, arrays: list[mx.array], offset: int) -> None:
        """Hold (this cache being empty) the first `offset` tokens' keys and values that `arrays` (laid out as
        `buffers`) hold, with room for more."""
        capacity = self.capacity_for(offset)
        self.hold([pad(a[..., :offset, :], 0, capacity - offset) for a in arrays])
        self.offset, self.start = offset, mx.array([offset])

    @property
    def position(self) -> mx.array:
        return self.start + self.shift

    def mask(self, tokens: int) -> str | mx.array:
        """One token (the compiled step): (1, 1, 1, capacity), the columns up to its position `start` (computed
        once per pass: the loop's `Positions` hands it to every layer). Several: "causal" over the filled columns
        `update` returns (the fast causal attention a prompt needs)."""
        if tokens > 1:
            return "causal"
        return (mx.arange(self.capacity_for(tokens)) <= self.start)[None, None, None]

    def keeps(self, count: int) -> bool:
        return count <= self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self.start = mx.array([self.offset])
        if self.offset < self.shifted_at:
            self.shift = mx.array([0])
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.buffers) if self.keys is not None else 0

    @property
    def state(self) -> list[mx.array]:
        return [*self.buffers, self.start] if self.keys is not None else [self.start]

    @classmethod
    def saved_as(cls) -> type:
        return KVCache

    def empty(self) -> "FixedKVCache":
        return FixedKVCache()

    def snapshot(self) -> Snapshot:
        arrays = [a[..., : self.offset, :] for a in self.buffers] if self.keys is not None else []
        shifted = self.shift.item()
        return Snapshot(arrays, self.offset, shifts=[shifted] if shifted else [], shifted_at=self.shifted_at)

    def restore(self, snapshot: Snapshot) -> None:
        """Hold a snapshot of this kind or of the growing kind it stands for (one row, unpadded), with room for more."""
        self.keys = self.values = None
        self.offset, self.start = 0, mx.array([0])
        self.shift, self.shifted_at = mx.array(snapshot.shifts or [0]), snapshot.shifted_at
        if snapshot.arrays:
            self.take(snapshot.arrays, snapshot.offset)

    def prefix(self, count: int) -> "FixedKVCache":
        fresh = self.empty()
        if count:
            fresh.take(self.buffers, min(count, self.offset))
        if count >= self.shifted_at:
            fresh.shift, fresh.shifted_at = self.shift, self.shifted_at
        return fresh


class FixedQuantizedKVCache(Quantized, FixedKVCache):
    """A `FixedKVCache` of `Quantized` keys and values (`--kv-bits` in the compiled step): `keys` and `values` are
    (codes, scales, biases) triples of buffers."""

    capabilities = FixedKVCache.capabilities | Can.QUANTIZED

    @classmethod
    def saved_as(cls) -> type:
        return QuantizedKVCache

    def empty(self) -> "FixedQuantizedKVCache":
        return FixedQuantizedKVCache(self.bits, self.group_size)

    def entries(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        return [*self.quantize(keys), *self.quantize(values)]

    def pair(self, buffers: list[mx.array]) -> tuple:
        return tuple(buffers[:3]), tuple(buffers[3:])

    @property
    def buffers(self) -> list[mx.array] | None:
        return [*self.keys, *self.values] if self.keys is not None else None


MARKS = 8
"""The states a recurrent cache remembers per row (`RecurrentCache.mark`): its memory stays a constant per layer."""
RECENT = 4
"""Of those, the latest ones always kept (a speculative round's, a prompt's end); the older are thinned evenly."""


class RecurrentCache(Cache):
    """What a recurrent token-mixer carries from one pass to the next: a short convolution's last inputs and a
    recurrent state, each a function of the whole prefix (no token axis).

    It can be snapshotted and restored, and its rows batched (`ROWS`), but never cut (no `CUT`): it goes back only to
    the counts it remembers, all its tokens, none, or a count `mark` remembered (each prefill chunk's end: the prompt
    cache restores the latest at or before the start a new prompt shares, and speculation's draft model each drafted
    token's). At most MARKS marks per row are kept, so its memory is the states times a constant.

    Rows may have seen different numbers of tokens (`lengths`). `padding` is set by whoever left-pads the next pass:
    that many leading columns of each row hold no token; the layer leaves the state unchanged over them (`valid`),
    and the pass consumes it.
    """

    capabilities = Can.SNAPSHOT | Can.ROWS
    holds_positions = False  # a state of the whole prefix: the model's attention layers' caches say where tokens sit

    def __init__(self):
        self.conv: mx.array | None = None  # (batch, kernel - 1, channels)
        self.recurrent: mx.array | None = None
        self.lengths: list[int] = [0]
        self.padding: list[int] = []
        self.marks: list[dict[int, list[mx.array]]] = [{}]  # per row: its states (rows of one) by token count

    @property
    def offset(self) -> int:
        return max(self.lengths)

    @property
    def position(self) -> int | mx.array:
        """Where each row's next token sits in its own sequence (one per row when they differ or a pass is padded)."""
        if len(set(self.lengths)) == 1 and not any(self.padding):
            return self.lengths[0]
        return mx.array([n - p for n, p in zip(self.lengths, self.row_padding())])

    def mask(self, tokens: int) -> str | mx.array | None:
        return "causal" if tokens > 1 else None

    def shift_positions(self, shift: int) -> None:
        """Nothing to shift: a recurrent state reads no positions (the attention layers' caches carry the shift)."""

    def rows(self) -> int:
        return len(self.lengths)

    def row_padding(self) -> list[int]:
        """This pass's leading padding per row (the state itself holds no columns)."""
        return self.padding or [0] * self.rows()

    def valid(self, tokens: int) -> mx.array | None:
        """(batch, tokens) bool: which of the next pass's columns hold tokens; None when all do."""
        if not any(self.padding):
            return None
        return mx.arange(tokens)[None, :] >= mx.array(self.padding)[:, None]

    def update(self, conv: mx.array, recurrent: mx.array | None, tokens: int) -> None:
        """Hold the states after a pass of `tokens` columns (its padding, now consumed, excluded)."""
        self.conv, self.recurrent = conv, recurrent
        self.lengths = [n + tokens - p for n, p in zip(self.lengths, self.row_padding())]
        self.padding = []

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv, self.recurrent) if a is not None]

    @property
    def nbytes(self) -> int:
        """The states' bytes and those of the marks (each array once: the latest mark may be the state itself)."""
        held = {id(a): a for a in self.state}
        held |= {id(a): a for row in self.marks for arrays in row.values() for a in arrays}
        return sum(a.nbytes for a in held.values())

    def row_state(self, row: int) -> list[mx.array]:
        """The states of one row, as a cache of one row holds them."""
        return self.state if self.rows() == 1 else [a[row : row + 1] for a in self.state]

    def mark(self) -> None:
        """Remember each row's state at its length (arrays are immutable: later passes replace them, so a mark is a
        reference), then thin the row's marks to MARKS."""
        if not self.state:
            return
        for row, (length, marks) in enumerate(zip(self.lengths, self.marks)):
            if length and length not in marks:
                marks[length] = self.row_state(row)
                thin(marks)

    def keeps(self, count: int) -> bool:
        """All tokens, none, or a marked count (of one row)."""
        return count in (0, self.offset) or (self.rows() == 1 and count in self.marks[0])

    def latest_kept(self, count: int) -> int:
        if self.keeps(count):
            return count
        return max((n for n in self.marks[0] if n <= count), default=0) if self.rows() == 1 else 0

    def empty(self) -> "RecurrentCache":
        return type(self)()

    def snapshot(self) -> Snapshot:
        """The states (arrays are immutable: later passes replace them), each row's length as its padding below the
        longest, and the marks."""
        marks = [dict(row) for row in self.marks]
        return Snapshot(self.state, self.offset, [self.offset - n for n in self.lengths], marks)

    def restore(self, snapshot: Snapshot) -> None:
        arrays = list(snapshot.arrays) + [None, None]
        self.conv, self.recurrent = arrays[0], arrays[1]
        self.lengths = [snapshot.offset - p for p in snapshot.padding] or [snapshot.offset]
        self.padding = []
        marks = snapshot.marks or [{} for _ in self.lengths]
        self.marks = [{n: m for n, m in row.items() if n <= length} for row, length in zip(marks, self.lengths)]

    def back_to(self, count: int) -> "RecurrentCache":
        """A new cache of this one row's state at the marked `count`, with the marks before it."""
        back = self.empty()
        back.restore(Snapshot(self.marks[0][count], count, [0], [dict(self.marks[0])]))
        return back

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        count = self.offset - n
        if 0 < count < self.offset and self.keeps(count):
            self.restore(self.back_to(count).snapshot())
            return n
        if 0 < count < self.offset:
            raise ValueError(
                f"a recurrent layer's state cannot forget its last {n} tokens (it is a function of the whole prefix); "
                "restore a snapshot taken before them instead"
            )
        return super().trim(n)

    def prefix(self, count: int) -> "RecurrentCache":
        if 0 < count < self.offset and self.keeps(count):
            return self.back_to(count)
        return super().prefix(count)

    def select(self, rows: list[int]) -> "RecurrentCache":
        if rows == list(range(self.rows())):
            return self
        picked, index = self.empty(), mx.array(rows)
        picked.lengths = [self.lengths[r] for r in rows]
        picked.marks = [dict(self.marks[r]) for r in rows]
        picked.conv, picked.recurrent = (a[index] if a is not None else None for a in (self.conv, self.recurrent))
        return picked

    @classmethod
    def merge(cls, caches: list["RecurrentCache"]) -> "RecurrentCache":
        """One cache holding the rows of `caches` one after another; an empty one starts from zero states."""
        if len(caches) == 1:
            return caches[0]
        merged = caches[0].empty()
        merged.lengths = [n for c in caches for n in c.lengths]
        merged.marks = [dict(row) for c in caches for row in c.marks]
        filled = [c for c in caches if c.conv is not None]
        if filled:
            like = filled[0].state
            parts = [
                c.state if c.conv is not None else [mx.zeros((c.rows(), *a.shape[1:]), a.dtype) for a in like]
                for c in caches
            ]
            held = [mx.concatenate(rows) for rows in zip(*parts)]
            merged.restore(Snapshot(held, merged.offset, [merged.offset - n for n in merged.lengths], merged.marks))
        return merged


def thin(marks: dict[int, list[mx.array]]) -> None:
    """Drop marks until MARKS are left: the latest RECENT stay; of the older, the one closest to the mark before it
    goes first, which keeps the others spread over the prefix."""
    while len(marks) > MARKS:
        counts = sorted(marks)
        older = counts[:-RECENT]
        gaps = [b - a for a, b in zip([0, *older], older)]
        del marks[older[gaps.index(min(gaps))]]
