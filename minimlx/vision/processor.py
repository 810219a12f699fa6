"""A model's image processor, read from its `preprocessor_config.json`: each picture to the `ImageInput` (pixels and
grid facts) its family's encoder reads.

`ImageProcessor` is the protocol a family's processor follows; `FixedSizeImages` resizes every picture to one size
(Gemma 3). The steps and their order are those of transformers' processors (Pillow's resampling on the 8-bit image,
then x * rescale_factor in float64 cast to float32, then (x - mean) / std), so the pixels equal theirs.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..core.vision import ImageInput
from ..errors import CheckpointError
from .images import open_image


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

    def __call__(self, images) -> list[ImageInput]:
        return [self.prepare(open_image(image)) for image in images]


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
