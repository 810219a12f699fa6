"""Images in: decoding picture files and preparing them as a model's image processor does."""

from .images import open_image
from .processor import FixedSizeImages, ImageProcessor, Normalisation, read_processor_config
from .tiling import TiledImages

__all__ = ["FixedSizeImages", "ImageProcessor", "Normalisation", "open_image", "read_processor_config", "TiledImages"]
