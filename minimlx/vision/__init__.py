"""Images in: decoding picture files and preparing them as a model's image processor does."""

from .images import ImageLimits, open_image
from .processor import FixedSizeImages, ImageProcessor, LongestEdgeImages, Normalisation, read_processor_config

__all__ = [
    "FixedSizeImages",
    "ImageLimits",
    "ImageProcessor",
    "LongestEdgeImages",
    "Normalisation",
    "open_image",
    "read_processor_config",
]
