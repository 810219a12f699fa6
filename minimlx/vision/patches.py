"""Dynamic resolution (Qwen2-VL, Qwen2.5-VL): each picture resized to the nearest size of whole merged patches within
a pixel budget, then cut into patches, flattened as transformers' Qwen2VLImageProcessor flattens them."""

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..core.vision import ImageInput
from ..errors import InvalidSettingError
from .processor import ImageProcessor, Normalisation

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) nearest the picture's, each a multiple of `factor`, with between `min_pixels` and
    `max_pixels` pixels and about the same aspect ratio (transformers' `smart_resize`)."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidSettingError(f"an image of {width} x {height} pixels is too thin (aspect ratio over 200)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class DynamicResolutionPatches(ImageProcessor):
    """Pictures to patches of `patch` x `patch` pixels, each repeated over `frames` frames (a still picture is a
    video of identical frames) and flattened (channel, frame, row, column), the patches ordered merge block by merge
    block (`merge` x `merge` neighbours together); grid (frames / frames, rows, columns) of patches."""

    patch: int = 14
    merge: int = 2
    frames: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = Image.Resampling.BICUBIC
    normalisation: Normalisation = Normalisation(mean=CLIP_MEAN, std=CLIP_STD)

    @classmethod
    def from_config(cls, config: dict) -> "DynamicResolutionPatches":
        size = config.get("size") or {}
        return cls(
            patch=int(config.get("patch_size", 14)),
            merge=int(config.get("merge_size", 2)),
            frames=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            normalisation=Normalisation.from_config(config, CLIP_MEAN, CLIP_STD),
        )

    def prepare(self, image: Image.Image) -> ImageInput:
        width, height = image.size
        factor = self.patch * self.merge
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=self.resample)
        x = self.normalisation(image)
        p, m, rows, cols = self.patch, self.merge, h // self.patch, w // self.patch
        x = x.reshape(3, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], self.frames, p, p))
        return ImageInput(np.ascontiguousarray(x.reshape(rows * cols, -1)), (1, rows, cols))
