"""A prompt with images: its soft tokens encoded and prefilled, so that decoding continues from the cache."""

from collections.abc import Sequence

import mlx.core as mx

from ..core.vision import PlacedImages
from ..errors import InvalidSettingError


def start_with_images(model, engine, ids: list[int], images: Sequence, cache, speculative: bool):
    """(the written-out prompt, a cache of `engine`'s kind holding all of it but its last token): a prompt with images
    starts a conversation, and is read by the model alone (not by a draft model)."""
    if cache is not None:
        raise InvalidSettingError("a prompt with images starts a conversation: give no cache or prompt_cache")
    if speculative:
        raise InvalidSettingError("a draft model cannot read images yet; drop the draft model or the images")
    cache = engine.make_cache()
    return prefill_images(model, ids, images, cache), cache


def prefill_images(model, ids: list[int], images: Sequence, cache: list) -> list[int]:
    """The prompt `ids` with its images' places written out (`expand_images`), all but its last token prefilled into
    `cache` (empty) with the images' soft tokens in place; returns the written-out prompt, whose last token the engine
    then feeds. `images`: paths, bytes or Pillow images, one per place in the prompt, in order."""
    if "vision" not in model:
        raise InvalidSettingError("this model reads text only; drop the images, or load an image-text model")
    if model.image_processor is None:
        raise InvalidSettingError("the model has no image processor: put its preprocessor_config.json beside it")
    ids = model.config.expand_images(list(ids))
    features = model.encode_images(mx.array(model.image_processor(images)))
    try:
        placed = PlacedImages.at(ids[:-1], model.config.image_token, features)
    except ValueError as e:
        raise InvalidSettingError(f"{e}; write the model's image token where each image goes") from None
    model(mx.array([ids[:-1]]), cache, images=placed, last_only=True)
    mx.eval([c.state for c in cache])
    return ids
