"""A prompt with images: their pixels read, their places written out, their soft tokens prefilled in one first pass
(each image's tokens see each other both ways), and the ids by which the prompt cache tells images apart."""

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.vision import ImageInput, image_owners
from ..errors import InvalidSettingError
from ..vision import ImageLimits
from .prefill import marked

DEFAULT_LIMITS = ImageLimits()
IMAGE_CACHE_MB = 256  # the encoder outputs an engine keeps by default (a 1024-token image of 2048 dims: 4 MB in bf16)


class EncodedImages:
    """Each image's soft tokens by the digest of its pixels and grid, the most recently used kept within `max_bytes`:
    a conversation resent with one more turn does not run the encoder on its images again (even where the prompt
    cache no longer holds them and the prompt is read again). Safe to share between threads."""

    def __init__(self, max_bytes: int = IMAGE_CACHE_MB * 2**20):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[bytes, mx.array] = OrderedDict()
        self.lock = threading.Lock()

    def __call__(self, model, inputs: Sequence, digests: Sequence[bytes], places: Sequence[int]) -> mx.array:
        """The soft tokens (places, dims) of `inputs` (their `digests`, `places[i]` rows each), image after image:
        those kept are reused, the others encoded together in one call of `model.encode_images` (evaluated)."""
        with self.lock:
            found = {d: self.entries[d] for d in digests if d in self.entries}
            for digest in found:
                self.entries.move_to_end(digest)
        missing = [i for i, d in enumerate(digests) if d not in found]
        if missing:
            encoded = model.encode_images([inputs[i] for i in missing])
            mx.eval(encoded)
            rows = np.cumsum([places[i] for i in missing])[:-1].tolist()
            for i, features in zip(missing, mx.split(encoded, rows) if rows else [encoded]):
                found[digests[i]] = features
                self.keep(digests[i], features)
        return mx.concatenate([found[d] for d in digests]) if len(digests) > 1 else found[digests[0]]

    def keep(self, digest: bytes, features: mx.array) -> None:
        with self.lock:
            if digest in self.entries or features.nbytes > self.max_bytes:
                return
            self.entries[digest] = features
            self.bytes += features.nbytes
            while self.bytes > self.max_bytes:
                _, dropped = self.entries.popitem(last=False)
                self.bytes -= dropped.nbytes


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images, prepared by the model's image processor: `inputs` (`ImageInput`s) for the places of `token`
    in the prompt (`places[i]` tokens per image, in order, in the runs the family's `image_runs` gives), `end` the
    index just past the last place, and `digests` each image's pixels and grid hashed (SHA-256), which `keyed` writes
    into the ids the prompt cache matches. Under a multimodal RoPE, `axes` (3, tokens) are the prompt's positions
    along each axis, and the tokens after the last image sit `shift` further on than their index (the caches are told
    so: `Cache.shift_positions`)."""

    inputs: tuple[ImageInput, ...]
    places: tuple[int, ...]
    token: int
    end: int
    digests: tuple[bytes, ...]
    axes: np.ndarray | None = None
    shift: int = 0

    @classmethod
    def read(
        cls, model, ids: list[int], images: Sequence, limits: ImageLimits = DEFAULT_LIMITS
    ) -> tuple[list[int], "PromptImages"]:
        """(the prompt `ids` with its images' places written out (`expand_images`), its images): `images` (paths,
        bytes or Pillow images) one per place, in order; InvalidSettingError in one line for a text-only model, a
        picture that cannot be read or passes `limits`, or places that do not match the images."""
        if "vision" not in model:
            raise InvalidSettingError("this model reads text only; drop the images, or load an image-text model")
        if model.image_processor is None:
            raise InvalidSettingError("the model has no image processor: put its preprocessor_config.json beside it")
        limits.check(images)
        config = model.config
        inputs = tuple(model.image_processor(images, limits.max_pixels))
        ids = config.expand_images(list(ids), inputs)
        places = tuple(config.image_places(image) for image in inputs)
        runs = image_runs(ids, config.image_token)
        if [stop - start for start, stop in runs] != [run for image in inputs for run in config.image_runs(image)]:
            raise InvalidSettingError(
                f"the prompt has {len(runs)} place(s) for images but {len(images)} image(s) came; write the model's "
                "image token where each image goes, once per image"
            )
        if runs and runs[-1][1] >= len(ids):
            raise InvalidSettingError("the prompt ends inside an image's places; write text after the image")
        digests = tuple(image.digest for image in inputs)
        axes = config.image_axes(ids, inputs)
        shift = 0 if axes is None else int(axes[0, -1]) - (len(ids) - 1)
        return ids, cls(inputs, places, config.image_token, runs[-1][1] if runs else 0, digests, axes, shift)

    def keyed(self, ids: list[int]) -> list[int]:
        """`ids` with each image's places as ids no token has (negative, from the image's digest): the prompt cache
        matches these, so a cache made with one image is never reused for another."""
        out = list(ids)
        for i, image in enumerate(image_owners(ids[: self.end], self.token, self.places)):
            if image < 0:
                continue
            chunk = self.digests[image][4 * (i % 8) : 4 * (i % 8) + 4]
            out[i] = -1 - (int.from_bytes(chunk, "little") & 0x7FFFFFFF)
        return out

    def feed(self, model, ids: list[int], cache: list, encoded: EncodedImages | None = None) -> None:
        """Feed `ids` (the prompt but its last token, which holds every image) into `cache` (empty) in one pass, the
        images' soft tokens in place (those `encoded` keeps reused); evaluated."""
        encoded = EncodedImages(0) if encoded is None else encoded
        features = encoded(model, self.inputs, self.digests, self.places)
        placed = model.config.place_images(ids, features, self.places, self.axes)
        marked(cache)
        model(mx.array([ids]), cache, images=placed, last_only=True)
        if self.axes is not None:
            for c in cache:
                c.shift_positions(self.shift)
        mx.eval([c.state for c in marked(cache)])

    def prefill_prompt(self, model, ids: list[int], cache: list, encoded: EncodedImages | None = None) -> mx.array:
        """`prefill.prefill_prompt` of a prompt holding these images: all but its last token in one pass with the
        images in place (their soft tokens from `encoded` where it keeps them), then its last token alone; the logits
        (1, 1, vocab) of that token (lazy)."""
        self.feed(model, ids[:-1], cache, encoded)
        logits = model(mx.array([ids[-1:]], dtype=mx.int32), cache, last_only=True)
        marked(cache)
        return logits


def image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, stop) of each run of `token` in `ids`."""
    runs = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def start_with_images(
    model, engine, ids: list[int], images: Sequence, cache, speculative: bool, limits: ImageLimits = DEFAULT_LIMITS
):
    """(the written-out prompt, `cache` (empty; None: a new one of `engine`'s kind) holding all of it but its last
    token): a prompt with images starts a conversation, and is read by the model alone (not by a draft model)."""
    if cache is not None and any(c.offset for c in cache):
        raise InvalidSettingError("a prompt with images starts a conversation: give an empty cache or none")
    if speculative:
        raise InvalidSettingError("a draft model cannot read images yet; drop the draft model or the images")
    cache = engine.make_cache() if cache is None else cache
    ids, placed = PromptImages.read(model, ids, images, limits)
    placed.feed(model, ids[:-1], cache, engine.encoded_images)
    return ids, cache
