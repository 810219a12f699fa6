"""Idefics3's and SmolVLM's image processor: a picture resized by its longest edge, cut into square tiles plus the
whole picture shrunk to one tile (the global image).

The sizes and the steps are those of transformers' `Idefics3ImageProcessorPil` (whose SmolVLM twin is the same):
the 8-bit picture resized with Pillow so that its longest edge is `size.longest_edge` (each side's other rounded up
to even, none above 4096), resized again so that both sides are multiples of the tile, cut into tiles row by row
and followed by the global image, each rescaled and normalised. Every tile is a full square, so the processor's
padding (to the largest picture of a batch) and its pixel mask add nothing a single image needs.
"""

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..core.vision import ImageInput
from ..errors import CheckpointError
from .processor import ImageProcessor, Normalisation

LARGEST_SIDE = 4096  # transformers' MAX_IMAGE_SIZE: no picture is resized past it


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest side `longest` and the aspect kept (the other side truncated, then rounded up
    to even), then shrunk where a side exceeds `LARGEST_SIDE`."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > LARGEST_SIDE:
        width, height = LARGEST_SIDE, int(LARGEST_SIDE / aspect)
    elif height > width and height > LARGEST_SIDE:
        height, width = LARGEST_SIDE, int(LARGEST_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) with both sides rounded up to multiples of `tile`: the longer first, the shorter from it
    through the aspect."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclass(frozen=True)
class TiledImages(ImageProcessor):
    """Pictures -> pixels (tiles, channels, tile, tile): with `split`, the tiles row by row and then the global image,
    grid (rows, columns); without, the picture resized to one tile, grid (0, 0)."""

    tile: int  # the tiles' side (`max_image_size.longest_edge`)
    longest_edge: int | None = None  # the first resize's longest side (`size.longest_edge`) ...
    size: tuple[int, int] | None = None  # ... or its (height, width); neither: no first resize
    split: bool = True
    resample: int = Image.Resampling.LANCZOS
    normalisation: Normalisation = Normalisation()

    @classmethod
    def from_config(cls, config: dict) -> "TiledImages":
        size, resize = config.get("size") or {}, config.get("do_resize", True)
        by_edge = resize and "longest_edge" in size
        if resize and not by_edge and not ("height" in size and "width" in size):
            raise CheckpointError(f"the image processor's size needs a longest_edge, or a height and a width: {size}")
        return cls(
            tile=int((config.get("max_image_size") or {}).get("longest_edge", 364)),
            longest_edge=int(size["longest_edge"]) if by_edge else None,
            size=(int(size["height"]), int(size["width"])) if resize and not by_edge else None,
            split=bool(config.get("do_image_splitting", True)),
            resample=int(config.get("resample", Image.Resampling.LANCZOS)),
            normalisation=Normalisation.from_config(config),
        )

    def resized(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=self.resample)

    def prepare(self, image: Image.Image) -> ImageInput:
        if self.longest_edge is not None:
            image = self.resized(image, *longest_edge_size(image.height, image.width, self.longest_edge))
        elif self.size is not None:
            image = self.resized(image, *self.size)
        rows = cols = 0
        if not self.split:
            tiles = [self.resized(image, self.tile, self.tile)]
        else:
            image = self.resized(image, *tile_multiple_size(image.height, image.width, self.tile))
            tiles = [image]
            if image.height > self.tile or image.width > self.tile:
                rows, cols, t = image.height // self.tile, image.width // self.tile, self.tile
                tiles = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
                tiles.append(self.resized(image, t, t))
        return ImageInput(np.stack([self.normalisation(tile) for tile in tiles]), (rows, cols))
