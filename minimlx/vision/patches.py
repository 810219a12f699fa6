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


def fit_patch_budget(height: int, width: int, patch: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The largest (height, width) at the picture's aspect with at most `max_patches` patches of `patch` pixels and
    sides multiples of `pooling` patches; a side that would round to nothing gets one `pooling` square, the other
    side its aspect's whole multiple (transformers' Gemma 4 `get_aspect_ratio_preserving_size`)."""
    factor = math.sqrt(max_patches * patch * patch / (height * width))
    side = pooling * patch
    h, w = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
    longest = max_patches // pooling**2 * side
    if h == 0 and w == 0:
        raise InvalidSettingError(f"an image of {width} x {height} pixels is too small to cut into patches")
    if h == 0:
        h, w = side, min(width // height * side, longest)
    elif w == 0:
        h, w = min(height // width * side, longest), side
    if h * w > max_patches * patch * patch:
        raise InvalidSettingError(f"an image of {width} x {height} pixels is too thin for {max_patches} patches")
    return h, w


@dataclass(frozen=True)
class PooledPatches(ImageProcessor):
    """Pictures resized at their own aspect to fit `max_soft_tokens` soft tokens (`fit_patch_budget`), rescaled (no
    normalising by default), cut into `patch` x `patch` patches flattened (row, column, channel), row-major: pixels
    (patches, patch * patch * channels), grid (rows, columns) of patches (Gemma 4's processor, less its padding)."""

    patch: int
    pooling: int
    max_soft_tokens: int
    resample: int = Image.Resampling.BICUBIC
    normalisation: Normalisation = Normalisation(mean=None, std=None)

    @classmethod
    def from_config(cls, config: dict) -> "PooledPatches":
        return cls(
            patch=int(config.get("patch_size", 16)),
            pooling=int(config.get("pooling_kernel_size", 3)),
            max_soft_tokens=int(config.get("max_soft_tokens", 280)),
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            normalisation=Normalisation.from_config({"do_normalize": False, **config}, (0.0,) * 3, (1.0,) * 3),
        )

    def prepare(self, image: Image.Image) -> ImageInput:
        height, width = fit_patch_budget(
            image.height, image.width, self.patch, self.max_soft_tokens * self.pooling**2, self.pooling
        )
        if image.size != (width, height):
            image = image.resize((width, height), resample=self.resample)
        x = self.normalisation(image)
        rows, cols, p = height // self.patch, width // self.patch, self.patch
        patches = x.reshape(-1, rows, p, cols, p).transpose(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        return ImageInput(np.ascontiguousarray(patches), (rows, cols))
