"""Images in: decoding picture files and preparing their pixels as a model's image processor does."""

from .images import open_image
from .processor import ImageProcessor

__all__ = ["ImageProcessor", "open_image"]
