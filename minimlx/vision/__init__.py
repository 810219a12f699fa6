"""Images in: decoding picture files and preparing them as a model's image processor does."""

from .images import ImageLimits, open_image
from .processor import FixedSizeImages, ImageProcessor, LongestEdgeImages, Normalisation, read_processor_config
from .tiling import TiledImages

__all__ = [
    "FixedSizeImages",
    "ImageLimits",
    "ImageProcessor",
    "LongestEdgeImages",
    "Normalisation",
    "TiledImages",
    "open_image",
    "read_processor_config",
]
