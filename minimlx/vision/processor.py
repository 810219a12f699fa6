"""A model's image processor, read from its `preprocessor_config.json`: each picture to the `ImageInput` (pixels and
grid facts) its family's encoder reads.

`ImageProcessor` is the protocol a family's processor follows; `FixedSizeImages` resizes every picture to one size
(Gemma 3). The steps and their order are those of transformers' processors (Pillow's resampling on the 8-bit image,
then x * rescale_factor in float64 cast to float32, then (x - mean) / std), so the pixels equal theirs.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..core.vision import ImageInput
from ..errors import CheckpointError
from .images import MAX_PIXELS, open_image


def read_processor_config(folder) -> dict:
    """The image processor's settings a checkpoint folder saves (`preprocessor_config.json`, or
    `processor_config.json`'s image_processor entry)."""
    folder = Path(folder)
    own = folder / "preprocessor_config.json"
    if own.is_file():
        return json.loads(own.read_text())
    shared = folder / "processor_config.json"
    if shared.is_file() and isinstance(json.loads(shared.read_text()).get("image_processor"), dict):
        return json.loads(shared.read_text())["image_processor"]
    raise CheckpointError(f"{folder} has no preprocessor_config.json: the model's image processor is needed")


@dataclass(frozen=True)
class Normalisation:
    """x * rescale_factor (float64, cast to float32), then (x - mean) / std, each where the processor does it."""

    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, config: dict, mean=(0.5,) * 3, std=(0.5,) * 3) -> "Normalisation":
        normalise = config.get("do_normalize", True)
        return cls(
            rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
            mean=tuple(config.get("image_mean") or mean) if normalise else None,
            std=tuple(config.get("image_std") or std) if normalise else None,
        )

    def __call__(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> (channels, height, width) float32."""
        x = np.asarray(image).transpose(2, 0, 1)
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32)
        if self.mean is not None:
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            x = (x - mean[:, None, None]) / std[:, None, None]
        return x


class ImageProcessor:
    """Pictures (paths, bytes or Pillow images) -> one `ImageInput` each, as the family's processor in transformers
    prepares them. A family's processor reads its settings (`from_config`) and prepares one RGB picture
    (`prepare`)."""

    @classmethod
    def from_config(cls, config: dict) -> "ImageProcessor":
        raise NotImplementedError

    @classmethod
    def from_folder(cls, folder) -> "ImageProcessor":
        return cls.from_config(read_processor_config(folder))

    def prepare(self, image: Image.Image) -> ImageInput:
        raise NotImplementedError

    def __call__(self, images, max_pixels: int = MAX_PIXELS) -> list[ImageInput]:
        """Each picture read (refused past `max_pixels`, from its header) and prepared."""
        return [self.prepare(open_image(image, max_pixels)) for image in images]


@dataclass(frozen=True)
class FixedSizeImages(ImageProcessor):
    """Every picture resized to `height` x `width`: pixels (channels, height, width), no grid."""

    height: int
    width: int
    resample: int = Image.Resampling.BILINEAR
    normalisation: Normalisation = Normalisation()

    @classmethod
    def from_config(cls, config: dict) -> "FixedSizeImages":
        if config.get("do_pan_and_scan"):
            raise CheckpointError("pan-and-scan cropping (do_pan_and_scan) is not supported yet; set it false")
        size = config.get("size") or {}
        if "height" not in size or "width" not in size:
            raise CheckpointError(f"the image processor's size needs a height and a width, not {size}")
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            resample=int(config.get("resample", Image.Resampling.BILINEAR)),
            normalisation=Normalisation.from_config(config),
        )

    def prepare(self, image: Image.Image) -> ImageInput:
        if image.size != (self.width, self.height):
            image = image.resize((self.width, self.height), resample=self.resample)
        return ImageInput(self.normalisation(image))


def fit_longest_edge(height: int, width: int, longest: int, multiple: int) -> tuple[int, int]:
    """(height, width) of a picture scaled down (never up) to fit `longest` x `longest`, keeping its aspect (each side
    floored), then each side rounded up to a multiple of `multiple`: Pixtral's rule."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = max(int(math.floor(height / ratio)), 1), max(int(math.floor(width / ratio)), 1)
    return (height - 1) // multiple * multiple + multiple, (width - 1) // multiple * multiple + multiple


@dataclass(frozen=True)
class LongestEdgeImages(ImageProcessor):
    """Each picture kept at its own aspect, scaled to fit `longest_edge` and to multiples of `multiple` pixels
    (`fit_longest_edge`): pixels (channels, height, width) and the grid (rows, columns) of `multiple`-pixel squares.
    Pixtral's processor (its `multiple` is the patch times the spatial merge, as Mistral 3's processor passes it)."""

    longest_edge: int
    multiple: int
    resample: int = Image.Resampling.BICUBIC
    normalisation: Normalisation = Normalisation()

    @classmethod
    def from_config(cls, config: dict, multiple: int | None = None) -> "LongestEdgeImages":
        size, patch = config.get("size") or {}, config.get("patch_size") or {}
        if "longest_edge" not in size:
            raise CheckpointError(f"the image processor's size needs a longest_edge, not {size}")
        if multiple is None:
            multiple = int(patch["height"] if isinstance(patch, dict) else patch or 16)
        return cls(
            longest_edge=int(size["longest_edge"]),
            multiple=multiple,
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            normalisation=Normalisation.from_config(config, PIXTRAL_MEAN, PIXTRAL_STD),
        )

    def prepare(self, image: Image.Image) -> ImageInput:
        height, width = fit_longest_edge(image.height, image.width, self.longest_edge, self.multiple)
        if image.size != (width, height):
            image = image.resize((width, height), resample=self.resample)
        return ImageInput(self.normalisation(image), (height // self.multiple, width // self.multiple))


PIXTRAL_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's, the processor's defaults
PIXTRAL_STD = (0.26862954, 0.26130258, 0.27577711)
