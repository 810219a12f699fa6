"""Prompt caches: the KV caches of prompts already read, kept so that a prompt starting the same way prefills only
what follows.

- `PromptCache` is the engine's: the caches of recent finished sequences, by their token ids (`serve` resends a
  conversation with one more turn). With a `PromptFolder` (`serve --prompt-cache-dir`) each entry is also a file,
  so a restarted server reads them back.
- `save_prompt_cache` writes one prompt's cache to a file (`minimlx cache-prompt`) and `load_prompt_cache` reads
  it back as a `SavedPrompt` (`run --prompt-cache-file`, `stream_generate(prompt_cache=...)`).

A file is safetensors: each layer's cached columns as arrays `layer.{i}.{j}` (keys and values; codes, scales and
biases of a quantized cache; latent vectors; a recurrent layer's states, then those of its marks), and metadata
naming what made them: the model's architecture, digests of its config, weights and tokenizer, the token ids, the
dtype and `kv_bits`. A file made by another model
(or the same at another --dtype or --kv-bits) would give wrong answers without failing, so reading one is refused.
"""

import hashlib
import json
import logging
import os
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..core.cache import (
    Can,
    ChunkedKVCache,
    IndexedLatentCache,
    KVCache,
    LatentCache,
    QuantizedKVCache,
    RecurrentCache,
    RotatingKVCache,
    SharedKVCache,
    SinkKVCache,
    Snapshot,
    quantized_cache,
    sink_cache,
)
from ..errors import InvalidSettingError, PromptCacheError
from .prefill import prefill, reusable, shared_start
from .prompt import check_ids, vocab_size
from .settings import check_kv_bits

FORMAT = "minimlx-prompt-cache-1"
KINDS = {
    kind.__name__: kind
    for kind in (
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
        ChunkedKVCache,
        SinkKVCache,
        LatentCache,
        IndexedLatentCache,
        RecurrentCache,
        SharedKVCache,
    )
}
ARRAYS = {
    "KVCache": 2,
    "QuantizedKVCache": 6,
    "RotatingKVCache": 2,
    "ChunkedKVCache": 2,
    "SinkKVCache": 2,
    "LatentCache": 1,
    "IndexedLatentCache": 2,
    "SharedKVCache": 0,
}  # per layer
SAMPLES = 64  # elements of each weight the weights' digest reads
log = logging.getLogger("minimlx.prompt_cache")


def digest(*parts: bytes | str) -> str:
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.encode() if isinstance(part, str) else part)
    return hashed.hexdigest()


def weights_digest(model: nn.Module) -> str:
    """A digest of every parameter's name, shape, dtype and SAMPLES of its values, evenly spaced: another
    checkpoint, or the same one in another dtype or packing, has another."""
    parts = []
    for name, weight in tree_flatten(model.parameters()):
        flat = weight.reshape(-1)
        sample = flat[:: max(1, flat.size // SAMPLES)][:SAMPLES]
        parts += [f"{name}{weight.shape}{weight.dtype}", np.array(sample.view(mx.uint8)).tobytes()]
    return digest(*parts)


def model_identity(model: nn.Module, tokenizer) -> dict[str, str]:
    """What a prompt cache file records of the model that made it, and is checked against when read."""
    config = getattr(model, "config", None)
    return {
        "architecture": type(config).__name__.removesuffix("Config") if config is not None else type(model).__name__,
        "config": digest(repr(config)),
        "weights": weights_digest(model),
        "tokenizer": digest(tokenizer.backend.to_str()) if tokenizer is not None else "",
    }


def kind(cache) -> dict:
    """What a file says of a layer's cache kind (and must say for it to fill `cache`, an empty cache of the
    reading model): its class (for the compiled step's fixed cache, the plain cache it is `saved_as`) and settings
    (window, sinks, bits)."""
    return {"kind": cache.saved_as().__name__, **cache.settings()}


def columns(cache) -> tuple[dict, list[mx.array]]:
    """(what a file says of one layer's cache, its arrays): the cache's snapshot; for a kind that cannot be cut, how
    many arrays its state is and the counts of its marks, whose states follow its own."""
    snapshot = cache.snapshot()
    if any(snapshot.padding) or cache.rows() != 1:
        raise ValueError("a prompt cache file holds one sequence, unpadded")
    described = kind(cache) | {"offset": snapshot.offset}
    if snapshot.shifts:  # a multimodal RoPE's shift of the positions after its images
        described |= {"shifts": snapshot.shifts, "shifted_at": snapshot.shifted_at}
    if cache.can(Can.QUANTIZED):
        described["group_size"] = cache.group_size
    if not cache.can(Can.CUT):
        marks = snapshot.marks[0] if snapshot.marks else {}
        described |= {"arrays": len(snapshot.arrays), "marks": sorted(marks)}
        return described, snapshot.arrays + [a for count in sorted(marks) for a in marks[count]]
    return described, snapshot.arrays


def held(described: dict) -> int | None:
    """The columns a layer's arrays hold: its tokens, or a window's last ones (and sinks); None for a state, which
    holds no columns."""
    if "marks" in described:
        return None
    offset = described["offset"]
    bound = described.get("window") or described.get("chunk")
    return min(offset, bound - 1) if bound else offset


def layer_arrays(described: dict) -> int:
    """How many arrays a file holds of a layer: its kind's, or a state's and as many per mark."""
    if "marks" in described:
        return described["arrays"] * (1 + len(described["marks"]))
    return ARRAYS[described["kind"]]


def restored(described: dict, arrays: list[mx.array]):
    """The cache of one layer from what a file holds of it."""
    settings = {key: described[key] for key in ("bits", "group_size", "window", "chunk", "sinks") if key in described}
    cache = KINDS[described["kind"]](**settings)
    marks = []
    if "marks" in described:
        count = described["arrays"]
        states = [arrays[i : i + count] for i in range(0, len(arrays), count)] if count else [[]]
        arrays, marks = states[0], [dict(zip(described["marks"], states[1:]))]
    shifts = {"shifts": described.get("shifts", []), "shifted_at": described.get("shifted_at", 0)}
    cache.restore(Snapshot(arrays, described["offset"], marks=marks, **shifts))
    return cache


def file_metadata(identity: dict[str, str], ids: list[int], cache: list, kv_bits: int | None) -> tuple[dict, dict]:
    """(the arrays, the metadata) of a prompt cache file of `ids` held in `cache`."""
    layers, arrays = [], {}
    for i, c in enumerate(cache):
        described, state = columns(c)
        layers.append(described)
        arrays |= {f"layer.{i}.{j}": a for j, a in enumerate(state)}
    if any(d["offset"] != len(ids) for d in layers):
        raise ValueError(f"the cache holds {layers[0]['offset']} tokens, not the {len(ids)} ids given")
    dtype = str(next(a.dtype for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)))
    metadata = {
        "format": FORMAT,
        **identity,
        "ids": json.dumps(ids),
        "layers": json.dumps(layers),
        "dtype": dtype.removeprefix("mlx.core."),
        "kv_bits": json.dumps(kv_bits),
    }
    return arrays, metadata


def write_file(path: Path, arrays: dict[str, mx.array], metadata: dict) -> None:
    """Write a safetensors file whole or not at all: into a hidden file beside it, then renamed over it."""
    temporary = path.with_name(f".{path.stem}-{uuid.uuid4().hex[:8]}.safetensors")
    try:
        mx.save_safetensors(str(temporary), arrays, metadata=metadata)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def cache_kv_bits(cache: list) -> int | None:
    """The bits of a cache's quantized layers (None: none is quantized)."""
    return next((c.bits for c in cache if c.can(Can.QUANTIZED)), None)


def save_prompt_cache(
    path: str | os.PathLike,
    model: nn.Module,
    tokenizer,
    ids: list[int],
    cache: list | None = None,
    kv_bits: int | None = None,
    prefill_step: int = 512,
) -> int:
    """Write the cache of the tokens `ids` to the safetensors file `path` (atomically: a reader sees the old file
    or the new one) and return its bytes; `load_prompt_cache` reads it. `cache` (one sequence's, of `model`) holds
    those tokens; without one, `ids` are read into a new cache first, quantized with `kv_bits`."""
    ids = check_ids(ids, vocab_size(model))
    if cache is None:
        check_kv_bits(kv_bits)
        cache = [quantized_cache(c, kv_bits) for c in model.make_cache()]
        prefill(model, ids, cache, prefill_step)
        mx.eval([c.state for c in cache])
    path = Path(path)
    arrays, metadata = file_metadata(model_identity(model, tokenizer), ids, cache, cache_kv_bits(cache))
    try:
        write_file(path, arrays, metadata)
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise PromptCacheError(f"cannot write the prompt cache {path} ({reason}); pick a writable path") from None
    return path.stat().st_size


@dataclass
class SavedPrompt:
    """A prompt's cache as a file held it: the prompt's token ids and every layer's cache of them."""

    ids: list[int]
    cache: list
    kv_bits: int | None

    def holding(self, count: int, fresh: list) -> list:
        """A new cache holding the first `count` saved tokens (this one stays as it is), of the kinds of `fresh`
        (a cache of the engine that continues it: the compiled step's where it has one)."""
        if count == 0:
            return fresh
        return [into(f, c.prefix(count)) for f, c in zip(fresh, self.cache)]

    def start(self, prompt: list[int], fresh: list) -> tuple[int, list]:
        """(how many first tokens of `prompt` the saved cache supplies, a cache holding them): all the saved tokens
        when `prompt` continues them, else the start they share (the last prompt token is always left to feed,
        its logits are what comes next), none where a sliding-window layer has dropped what that start needs."""
        count = reusable(self.cache, shared_start(self.ids, prompt))
        return count, self.holding(count, fresh)


def into(fresh, cache):
    """`cache`'s tokens in `fresh` where that is the compiled step's fixed cache standing for `cache`'s kind (restored
    from `cache`'s snapshot), else `cache` itself."""
    if fresh.can(Can.FIXED) and kind(fresh) == kind(cache):
        fresh.restore(cache.snapshot())
        return fresh
    return cache


def expected_kinds(model: nn.Module, kv_bits: int | None, max_kv_size: int | None = None) -> list[dict]:
    """What a file of `kv_bits` (and `max_kv_size`) must say of each layer for `model` to read it (`kind`)."""
    return [kind(sink_cache(quantized_cache(c, kv_bits), max_kv_size)) for c in model.make_cache()]


def read_file(
    path: Path, model: nn.Module, identity: dict[str, str], kv_bits: int | None = None, max_kv_size: int | None = None
) -> SavedPrompt:
    """The prompt cache file at `path` if the model of `identity` (`model`) made it (with caches bounded to
    `max_kv_size`), and, when `kv_bits` is not None, of keys and values of those bits; else a PromptCacheError of
    one line."""
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise PromptCacheError(f"cannot read {path} ({reason}); make it with minimlx cache-prompt") from None
    if metadata.get("format") != FORMAT:
        raise PromptCacheError(f"{path} is not a minimlx prompt cache file; make one with minimlx cache-prompt")
    check_identity(path, metadata, identity)
    try:
        ids, layers, bits = (json.loads(metadata[key]) for key in ("ids", "layers", "kv_bits"))
        if kv_bits is not None and expected_kinds(model, kv_bits) != expected_kinds(model, bits):
            made = f"{bits}-bit keys and values" if bits else "float keys and values"
            raise PromptCacheError(
                f"{path} holds {made}, not {kv_bits}-bit ones; pass {f'--kv-bits {bits}' if bits else 'no --kv-bits'}"
                f" or make it again with --kv-bits {kv_bits}"
            )
        wanted = expected_kinds(model, bits, max_kv_size)
        if len(layers) != len(wanted) or [{k: d[k] for k in w} for d, w in zip(layers, wanted)] != wanted:
            raise ValueError("its layers' caches are not of the kinds this model uses")
        cache = []
        for i, described in enumerate(layers):
            state = [arrays[f"layer.{i}.{j}"] for j in range(layer_arrays(described))]
            columns_held = held(described)
            if described["offset"] != len(ids) or any(
                columns_held is not None and a.shape[-2] != columns_held for a in state
            ):
                raise ValueError(f"layer {i} holds other columns than its {len(ids)} tokens")
            cache.append(restored(described, state))
        mx.eval([c.snapshot().held() for c in cache])  # here, on this thread's stream: the marks with the states
    except PromptCacheError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise PromptCacheError(f"{path} is damaged ({e}); make it again with minimlx cache-prompt") from None
    return SavedPrompt(ids, cache, bits)


def check_identity(path: Path, metadata: dict, identity: dict[str, str]) -> None:
    """Refuse, in one line, a file another model (or tokenizer, or these weights in another dtype) made."""
    if metadata.get("architecture") != identity["architecture"]:
        raise PromptCacheError(
            f"{path} was made by a {metadata.get('architecture')} model, not this {identity['architecture']} one; "
            "make it again with this model (minimlx cache-prompt)"
        )
    made = {
        "config": f"by another {identity['architecture']} model (its config differs)",
        "tokenizer": "with another tokenizer",
        "weights": "from other weights than this model's (another checkpoint, or this one at another --dtype)",
    }
    for key, how in made.items():
        if metadata.get(key) != identity[key]:
            raise PromptCacheError(f"{path} was made {how}; make it again with this model (minimlx cache-prompt)")


def load_prompt_cache(path: str | os.PathLike, model: nn.Module, tokenizer, kv_bits: int | None = None) -> SavedPrompt:
    """The prompt cache file `save_prompt_cache` (or `minimlx cache-prompt`) wrote, checked against `model` and
    `tokenizer`: one made by another model, a damaged file, or (with `kv_bits`) one of other bits is refused
    (PromptCacheError, one line). Its caches keep the file's kv bits."""
    return read_file(Path(path), model, model_identity(model, tokenizer), kv_bits)


def nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


def holds(ids: list[int], cache: list, other: list[int]) -> bool:
    """Whether `cache` (of `ids`) can give every token of `other`: it starts `ids`, and every layer goes back there."""
    return ids[: len(other)] == other and reusable(cache, len(other)) == len(other)


class PromptCache:
    """The caches of the last `size` finished sequences (at most `max_bytes` of them in all), by token ids, for
    prompts that start the same way; the least recently used leave first. With a `folder`, each entry is also a
    file there, and the cache starts with the entries the folder's files hold."""

    def __init__(self, size: int, max_bytes: int | None = None, folder: "PromptFolder | None" = None):
        self.size, self.max_bytes, self.folder = size, max_bytes, folder
        self.entries: list[tuple[list[int], list]] = folder.read(size, max_bytes) if folder is not None else []
        self.latest: dict[str, list[int]] = {}  # a conversation's key -> the ids of its newest entry

    def fits(self, entries: list) -> bool:
        within = self.max_bytes is None or sum(nbytes(c) for _, c in entries) <= self.max_bytes
        return len(entries) <= self.size and within

    def store(self, ids: list[int], cache: list, key: str | None = None) -> None:
        """Keep `cache` (holding `ids`) as an entry. With a conversation's `key`, the entry replaces that
        conversation's previous one (its history may have been edited since: the old entry would only push other
        conversations' entries out)."""
        count = min(len(ids), cache[0].offset)
        if count == 0 or not all(c.keeps(count) for c in cache):
            return  # a sliding-window layer has dropped tokens it would need
        for c in cache:
            c.trim(c.offset - count)
        ids = ids[:count]
        if not self.fits([(ids, cache)]):
            return
        superseded = self.latest.get(key) if key is not None else None
        kept = [  # not those the new one holds (and can go back to), nor its conversation's previous entry
            entry for entry in self.entries if not holds(ids, cache, entry[0]) and entry[0] is not superseded
        ]
        kept.append((ids, cache))
        if key is not None:
            self.latest[key] = ids
        while not self.fits(kept):
            kept.pop(0)
        if self.folder is not None:
            for entry in self.entries:
                if not any(entry is k for k in kept):
                    self.folder.remove(entry[0])
            self.folder.write(ids, cache)
        self.entries = kept

    def fetch(self, prompt: list[int]) -> tuple[int, list | None]:
        """(tokens reused, a fresh cache holding them) for the entry sharing the longest start with `prompt` that it
        can go back to (a recurrent state: its latest mark at or before the shared start); the last prompt token is
        always left to feed."""
        best, found = 0, None
        for i, (ids, cache) in enumerate(self.entries):
            shared = reusable(cache, shared_start(ids, prompt))
            if shared > best:
                best, found = shared, i
        if found is None:
            return 0, None
        ids, cache = entry = self.entries.pop(found)
        self.entries.append(entry)
        if self.folder is not None:
            self.folder.touch(ids)
        return best, [c.prefix(best) for c in cache]

    def flush(self) -> None:
        """Return once the folder's files are written (at once without a folder)."""
        if self.folder is not None:
            self.folder.flush()


class PromptFolder:
    """A folder holding a `PromptCache`'s entries as prompt cache files (`serve --prompt-cache-dir`), so that the
    next server starts with them.

    A thread of its own writes and removes the files, so the engine's steps never wait on the disk, and a file is
    written whole or not at all. File names start with a digest of the model and its kv bits: servers of other
    models (or of other kv bits or max_kv_size) can share the folder, their files left alone; a damaged file of
    this model is removed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        tokenizer,
        kv_bits: int | None = None,
        max_kv_size: int | None = None,
    ):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidSettingError(
                f"cannot make the prompt cache folder {path} ({e.strerror or e}); pick another --prompt-cache-dir"
            ) from None
        self.model, self.identity, self.max_kv_size = model, model_identity(model, tokenizer), max_kv_size
        self.prefix = digest(json.dumps(self.identity, sort_keys=True), json.dumps([kv_bits, max_kv_size]))[:16]
        self.tasks: deque = deque()
        self.lock = threading.Lock()
        self.worker: threading.Thread | None = None

    def file(self, ids: list[int]) -> Path:
        return self.path / f"{self.prefix}-{digest(json.dumps(ids))[:32]}.safetensors"

    def read(self, size: int, max_bytes: int | None) -> list[tuple[list[int], list]]:
        """The entries this model's files hold, least recently used first: the most recently used that fit in
        `size` entries and `max_bytes`; the others' files are removed. One log line for the files of other models,
        one for each damaged file."""
        mine, others = [], 0
        for file in self.path.glob("*.safetensors"):
            if file.name.startswith(f".{self.prefix}-"):  # a write cut short (the process was killed)
                file.unlink(missing_ok=True)
            elif file.name.startswith(f"{self.prefix}-"):
                mine.append((file.stat().st_mtime, file))
            elif not file.name.startswith("."):
                others += 1
        if others:
            log.warning(f"prompt cache: skipped {others} file(s) in {self.path} made by other models (or --kv-bits)")
        entries, held = [], 0
        for _, file in sorted(mine, reverse=True):
            try:
                saved = read_file(file, self.model, self.identity, max_kv_size=self.max_kv_size)
            except PromptCacheError as e:
                log.warning(f"prompt cache: removed a file it cannot use: {e}")
                file.unlink(missing_ok=True)
                continue
            if len(entries) == size or (max_bytes is not None and held + nbytes(saved.cache) > max_bytes):
                file.unlink(missing_ok=True)
                continue
            held += nbytes(saved.cache)
            entries.insert(0, (saved.ids, saved.cache))
        return entries

    def write(self, ids: list[int], cache: list) -> None:
        """Queue the file of an entry; its arrays are made whole here, in the engine's thread (whose stream made
        them), so that the writer only copies bytes."""
        arrays, metadata = file_metadata(self.identity, ids, cache, cache_kv_bits(cache))
        arrays = {name: mx.contiguous(a) for name, a in arrays.items()}
        mx.eval(list(arrays.values()))
        self.queue(write_file, self.file(ids), arrays, metadata)

    def remove(self, ids: list[int]) -> None:
        self.queue(lambda file: file.unlink(missing_ok=True), self.file(ids))

    def touch(self, ids: list[int]) -> None:
        """Mark an entry's file as just used (its modification time orders the files at the next start)."""
        self.queue(lambda file: file.exists() and os.utime(file), self.file(ids))

    def queue(self, task, *args) -> None:
        with self.lock:
            self.tasks.append((task, args))
            if self.worker is None:  # not a daemon: the process exits once the files are written
                self.worker = threading.Thread(target=self.work, name="minimlx-prompt-cache")
                self.worker.start()

    def work(self) -> None:
        while True:
            with self.lock:
                if not self.tasks:
                    self.worker = None
                    return
                task, args = self.tasks.popleft()
            try:
                task(*args)
            except (OSError, RuntimeError) as e:  # a full disk: the entry stays in memory only
                log.warning(f"prompt cache: cannot write to {self.path} ({e})")

    def flush(self) -> None:
        with self.lock:
            worker = self.worker
        if worker is not None:
            worker.join()
