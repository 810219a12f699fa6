"""The cache protocol (`minimlx.core.cache.Cache`): every cache kind in minimlx derives from it, and each does what
its declared capabilities (`Can`) say: cut back to any kept token, snapshot and restore, rows selected and merged,
a bounded window, sinks, quantized entries, buffers written at a position, a fixed capacity."""

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import minimlx
from minimlx.core.cache import (
    Cache,
    Can,
    ChunkedKVCache,
    FixedKVCache,
    FixedQuantizedKVCache,
    IndexedLatentCache,
    KVCache,
    LatentCache,
    QuantizedKVCache,
    RecurrentCache,
    RotatingKVCache,
    SharedKVCache,
    SinkKVCache,
)

WINDOW = 12  # tokens a bounded kind's layer sees; the tests that cut stay below it
HEADS, DIMS = 2, 64


def subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | subclasses(sub)
    return found


def scanned_cache_classes() -> set[type]:
    """Every class defined in minimlx's modules that has the methods of a cache (whatever it derives from)."""
    found = set()
    for module in pkgutil.walk_packages(minimlx.__path__, "minimlx."):
        if module.name.endswith("__main__"):
            continue
        for _, cls in inspect.getmembers(importlib.import_module(module.name), inspect.isclass):
            if cls.__module__.startswith("minimlx.") and {"trim", "keeps", "mask", "state"} <= set(dir(cls)):
                found.add(cls)
    return found


@dataclass
class Kind:
    """How a test makes a cache kind, the entries one `update` takes, and the float keys and values it returned."""

    make: Callable[[], Cache]
    latent: bool = False

    def entries(self, tokens: int, rows: int = 1, seed: int = 0) -> list[mx.array]:
        key = mx.random.key(seed)
        if self.latent:
            return [mx.random.normal((rows, 1, tokens, DIMS), key=key)]
        k, v = mx.random.split(key)
        return [
            mx.random.normal((rows, HEADS, tokens, DIMS), key=k),
            mx.random.normal((rows, HEADS, tokens, DIMS), key=v),
        ]

    def attend(self, cache: Cache, tokens: int, rows: int = 1, seed: int = 0) -> mx.array:
        """Add `tokens` entries (of `seed`) and return the attention output of as many queries over what the cache
        returns, under the cache's mask."""
        mask = cache.mask(tokens)
        returned = cache.update(*self.entries(tokens, rows, seed))
        if self.latent:
            keys = values = returned
        else:
            keys, values = returned
            if cache.can(Can.QUANTIZED):
                keys, values = cache.dequantize(keys), cache.dequantize(values)
        heads = keys.shape[1]
        q = mx.random.normal((rows, heads, tokens, keys.shape[-1]), key=mx.random.key(seed + 1000))
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=DIMS**-0.5, mask=mask)
        mx.eval(out)
        return out

    def filled(self, chunks: list[int], rows: int = 1) -> Cache:
        """A cache fed the entries of `sum(chunks)` tokens (seed 0), one update per chunk."""
        cache, entries, start = self.make(), self.entries(sum(chunks), rows), 0
        for count in chunks:
            cache.update(*(e[..., start : start + count, :] for e in entries))
            start += count
        mx.eval(cache.state)
        return cache


KINDS = {
    KVCache: Kind(KVCache),
    QuantizedKVCache: Kind(lambda: QuantizedKVCache(8)),
    LatentCache: Kind(LatentCache, latent=True),
    IndexedLatentCache: Kind(IndexedLatentCache),  # two arrays a token, as keys and values are
    RotatingKVCache: Kind(lambda: RotatingKVCache(WINDOW)),
    SinkKVCache: Kind(lambda: SinkKVCache(WINDOW)),
    ChunkedKVCache: Kind(lambda: ChunkedKVCache(WINDOW)),
    FixedKVCache: Kind(FixedKVCache),
    FixedQuantizedKVCache: Kind(lambda: FixedQuantizedKVCache(8)),
}
CONCRETE = sorted(KINDS, key=lambda cls: cls.__name__)
# Kinds whose entries are no keys and values, tested through the layers that fill them.
# tests/test_archs_families_hybrid.py; tests/test_archs_gemma4.py and test_decode_batching.py (gemma4_text)
TESTED_WITH_THEIR_LAYERS = {RecurrentCache, SharedKVCache}


def arrays(cache: Cache) -> list[np.ndarray]:
    return [np.array(a) for a in cache.snapshot().arrays]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def test_every_cache_class_derives_from_the_protocol():
    derived = subclasses(Cache)
    assert derived == scanned_cache_classes() - {Cache}
    concrete = {cls for cls in derived if not inspect.isabstract(cls)}
    assert concrete == set(KINDS) | TESTED_WITH_THEIR_LAYERS  # each kind is tested below or with its layers


def test_every_kind_declares_snapshot():
    assert all(cls.capabilities & Can.SNAPSHOT for cls in {*KINDS, *TESTED_WITH_THEIR_LAYERS})


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_snapshot_restores_exactly(cls):
    kind = KINDS[cls]
    cache = kind.filled([5, 1, 1])
    snapshot, held = cache.snapshot(), arrays(cache)
    restored = cache.empty()
    restored.restore(snapshot)
    assert restored.offset == cache.offset == 7 and same(arrays(restored), held)
    after = kind.attend(cache, 1, seed=9), kind.attend(restored, 1, seed=9)
    assert np.array_equal(np.array(after[0]), np.array(after[1]))
    kind.attend(cache, 3, seed=10)  # the snapshot stays as it was taken
    assert same([np.array(a) for a in snapshot.arrays], held)
    again = cache.empty()
    again.restore(snapshot)
    assert np.array_equal(np.array(kind.attend(again, 1, seed=9)), np.array(after[0]))


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_cut_gives_what_fewer_tokens_give(cls):
    """Where `CUT` is declared, trim and prefix to any count below the window leave what a cache fed only those
    tokens holds: the same attention output for the next token. Without it, only all or none."""
    kind = KINDS[cls]
    held = 9
    for count in range(held + 1):
        cache = kind.filled([4, 3, 1, 1])
        if not cache.can(Can.CUT):
            assert cache.keeps(count) == (count in (0, held))
            continue
        assert cache.keeps(count)
        fewer = kind.make()
        if count:  # the same first tokens, fed as one prompt
            fewer.update(*(e[..., :count, :] for e in kind.entries(held)))
        prefix = cache.prefix(count)
        assert cache.trim(held - count) == held - count and cache.offset == prefix.offset == count
        expected = np.array(kind.attend(fewer, 1, seed=20))
        assert np.array_equal(np.array(kind.attend(cache, 1, seed=20)), expected)
        assert np.array_equal(np.array(kind.attend(prefix, 1, seed=20)), expected)


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_window_bounds_what_is_kept(cls):
    """A `WINDOW` kind holds a bounded number of columns however long the text, and refuses to go back before what it
    dropped; other kinds keep every token."""
    kind = KINDS[cls]
    cache = kind.filled([20, 1, 1])
    columns = cache.snapshot().arrays[0].shape[-2]
    if cache.can(Can.WINDOW):
        assert columns == WINDOW - 1 and not cache.keeps(5)
        with pytest.raises(ValueError):
            cache.trim(17)
        assert cache.keeps(22) and cache.keeps(0)
    else:
        assert columns == 22 and all(cache.keeps(n) for n in range(23))


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_sinks_keep_the_first_tokens(cls):
    kind = KINDS[cls]
    if not cls.capabilities & Can.SINKS:
        return
    first = kind.entries(21)
    cache = kind.filled([20, 1])
    held = cache.snapshot().arrays
    assert np.array_equal(np.array(held[0][..., : cache.sinks, :]), np.array(first[0][..., : cache.sinks, :]))
    assert held[0].shape[-2] == WINDOW - 1


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_rows_select_and_merge_reproduce_each_row(cls):
    """Where `ROWS` is declared, a merge of caches of different lengths decodes each row as its own cache does, and
    `select` gives a row's own cache back; without it, a merge of two is refused."""
    kind = KINDS[cls]
    lengths = [[3, 1], [6]]
    caches = [kind.filled(t) for t in lengths]
    if not cls.capabilities & Can.ROWS:
        with pytest.raises(ValueError):
            cls.merge(caches)
        assert cls.merge(caches[:1]) is caches[0] and caches[0].select([0]) is caches[0]
        return
    merged = cls.merge(caches)
    assert merged.rows() == 2 and merged.row_padding() == [2, 0] and merged.offset == 6
    entries = kind.entries(1, rows=2, seed=30)
    q = mx.random.normal((2, entries[0].shape[1], 1, DIMS), key=mx.random.key(31))
    together = attend_entries(merged, entries, q)
    for row, cache in enumerate(caches):
        alone = attend_entries(cache, [e[row : row + 1] for e in entries], q[row : row + 1])
        np.testing.assert_allclose(np.array(together[row : row + 1]), np.array(alone), rtol=0, atol=1e-6)
        picked = merged.select([row])
        assert picked.offset == cache.offset and picked.row_padding() == [0]
        assert same(arrays(picked), arrays(cache))


def attend_entries(cache: Cache, entries: list[mx.array], q: mx.array) -> mx.array:
    mask = cache.mask(1)
    returned = cache.update(*entries)
    keys, values = (returned, returned) if len(entries) == 1 else returned
    if cache.can(Can.QUANTIZED):
        keys, values = cache.dequantize(keys), cache.dequantize(values)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=DIMS**-0.5, mask=mask)
    mx.eval(out)
    return out


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_quantized_entries_are_triples(cls):
    kind = KINDS[cls]
    cache = kind.filled([4])
    returned = cache.update(*kind.entries(1, seed=40))
    assert isinstance(returned[0], tuple) == bool(cls.capabilities & Can.QUANTIZED)
    if cache.can(Can.QUANTIZED):
        assert len(cache.snapshot().arrays) == 6 and cache.settings()["bits"] == 8


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_buffers_written_at_start_match_update(cls):
    """A `BUFFERS` kind takes a token written into its buffers at `start` (`reserve`, `written`), as the native
    block step and the compiled step write it, and then holds what `update` would."""
    kind = KINDS[cls]
    if not cls.capabilities & Can.BUFFERS:
        return
    written, updated = kind.filled([4]), kind.filled([4])
    keys, values = kind.entries(1, seed=50)
    updated.update(keys, values)
    new = [*written.quantize(keys), *written.quantize(values)] if written.can(Can.QUANTIZED) else [keys, values]
    written.reserve(1)
    written.written([mx.slice_update(b, a, written.start, axes=(2,)) for b, a in zip(written.buffers, new)], 1)
    assert written.offset == updated.offset == 5 and same(arrays(written), arrays(updated))


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_fixed_capacity_stands_for_its_growing_kind(cls):
    """A `FIXED` kind keeps its capacity when cut, its position is an array, and its snapshot restores into the
    growing kind it is `saved_as` (and back), as the prompt cache moves tokens between them."""
    kind = KINDS[cls]
    cache = kind.filled([5, 1])
    if not cls.capabilities & Can.FIXED:
        assert cls.saved_as() is cls and isinstance(cache.position, int)
        return
    capacity = cache.capacity
    cache.trim(2)
    assert cache.capacity == capacity and cache.position.tolist() == [4]
    growing = cls.saved_as()(**cache.settings())
    growing.restore(cache.snapshot())
    back = cache.empty()
    back.restore(growing.snapshot())
    assert (
        growing.offset == back.offset == 4
        and same(arrays(growing), arrays(cache))
        and same(arrays(back), arrays(cache))
    )


@pytest.mark.parametrize("kind", [KVCache, lambda: RotatingKVCache(WINDOW)], ids=["KVCache", "RotatingKVCache"])
def test_shifted_positions_survive_merges_selections_prefixes_and_snapshots(kind):
    """A multimodal RoPE's shift (`shift_positions`): the tokens after it sit that much further on; a batch holds one
    per row, a prefix keeps it only once it holds the tokens before it, a snapshot (the fixed kind's too) keeps it."""

    def entries(tokens):
        return mx.zeros((1, HEADS, tokens, DIMS)), mx.zeros((1, HEADS, tokens, DIMS))

    shifted, plain = kind(), kind()
    shifted.update(*entries(5))
    shifted.shift_positions(-3)
    shifted.update(*entries(2))
    plain.update(*entries(4))
    assert shifted.position.tolist() == [4] and plain.position == 4
    merged = type(shifted).merge([shifted, plain])
    assert merged.position.tolist() == [4, 4] and merged.select([0]).position.tolist() == [4]
    assert merged.select([1]).position == 4
    assert shifted.prefix(6).position.tolist() == [3] and shifted.prefix(4).position == 4
    fixed = FixedKVCache()
    fixed.restore(shifted.snapshot())
    assert fixed.position.tolist() == [4] and fixed.prefix(4).position.tolist() == [4]
    back = kind()
    back.restore(fixed.snapshot())
    assert back.position.tolist() == [4]
