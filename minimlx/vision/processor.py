"""A model's image processor, read from its `preprocessor_config.json`: resize, rescale, normalise.

The steps and their order are those of transformers' processors (Pillow's resampling on the 8-bit image, then
x * rescale_factor in float64 cast to float32, then (x - mean) / std), so the pixels equal theirs.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import CheckpointError
from .images import open_image


@dataclass(frozen=True)
class ImageProcessor:
    """Images to a model's pixels (images, channels, height, width), float32."""

    height: int
    width: int
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    std: tuple[float, ...] | None = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, config: dict) -> "ImageProcessor":
        if config.get("do_pan_and_scan"):
            raise CheckpointError("pan-and-scan cropping (do_pan_and_scan) is not supported yet; set it false")
        size = config.get("size") or {}
        if "height" not in size or "width" not in size:
            raise CheckpointError(f"the image processor's size needs a height and a width, not {size}")
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            resample=int(config.get("resample", Image.Resampling.BILINEAR)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None,
            mean=tuple(config.get("image_mean", (0.5,) * 3)) if config.get("do_normalize", True) else None,
            std=tuple(config.get("image_std", (0.5,) * 3)) if config.get("do_normalize", True) else None,
        )

    @classmethod
    def from_folder(cls, folder) -> "ImageProcessor":
        """The processor a checkpoint folder saves (`preprocessor_config.json`, or `processor_config.json`'s
        image_processor entry)."""
        folder = Path(folder)
        own = folder / "preprocessor_config.json"
        if own.is_file():
            return cls.from_config(json.loads(own.read_text()))
        shared = folder / "processor_config.json"
        if shared.is_file() and isinstance(json.loads(shared.read_text()).get("image_processor"), dict):
            return cls.from_config(json.loads(shared.read_text())["image_processor"])
        raise CheckpointError(f"{folder} has no preprocessor_config.json: the model's image processor is needed")

    def resized(self, image) -> Image.Image:
        """One image (a path, bytes or a Pillow image) as the model sees it, before rescaling: RGB, at its size."""
        image = open_image(image)
        if image.size != (self.width, self.height):
            image = image.resize((self.width, self.height), resample=self.resample)
        return image

    def pixels(self, image) -> np.ndarray:
        """One image (a path, bytes or a Pillow image) -> (channels, height, width) float32."""
        x = np.asarray(self.resized(image)).transpose(2, 0, 1)
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32)
        if self.mean is not None:
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            x = (x - mean[:, None, None]) / std[:, None, None]
        return x

    def __call__(self, images) -> np.ndarray:
        """Images -> (images, channels, height, width) float32."""
        return np.stack([self.pixels(image) for image in images])
