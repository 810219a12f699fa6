"""Picture files (PNG, JPEG, WebP, GIF: its first frame) decoded with Pillow into RGB images."""

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import InvalidSettingError

MAX_PIXELS = 8192 * 8192  # the largest picture read: its size comes from the file's header, before any decoding
MAX_IMAGE_MB = 20.0  # the largest picture file read (OpenAI's limit per image)
MAX_IMAGES = 16  # the most pictures one prompt holds


@dataclass(frozen=True)
class ImageLimits:
    """What a prompt's pictures may be: at most `max_images` of them, each file at most `max_bytes` long and holding
    at most `max_pixels` pixels (read from its header, before decoding)."""

    max_pixels: int = MAX_PIXELS
    max_bytes: int = int(MAX_IMAGE_MB * 1e6)
    max_images: int = MAX_IMAGES

    def __post_init__(self):
        for name in ("max_pixels", "max_bytes", "max_images"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise InvalidSettingError(
                    f"the image limit {name} must be a whole number above 0, not {getattr(self, name)!r}"
                )

    @classmethod
    def of(cls, max_pixels: int | None = None, max_mb: float | None = None, max_images: int | None = None):
        """The limits the command line gives (None: the default)."""
        return cls(
            MAX_PIXELS if max_pixels is None else max_pixels,
            int((MAX_IMAGE_MB if max_mb is None else max_mb) * 1e6),
            MAX_IMAGES if max_images is None else max_images,
        )

    def check(self, images: Sequence) -> None:
        """InvalidSettingError in one line where there are too many `images` (paths, bytes or Pillow images) or a file
        is too long (a path's length from the file system, before reading it)."""
        if len(images) > self.max_images:
            raise InvalidSettingError(
                f"{len(images)} images came, more than the {self.max_images} one prompt may hold; send fewer"
            )
        for i, image in enumerate(images):
            size = len(image) if isinstance(image, (bytes, bytearray)) else None
            if isinstance(image, (str, Path)) and Path(image).is_file():
                size = Path(image).stat().st_size
            if size is not None and size > self.max_bytes:
                raise InvalidSettingError(
                    f"image {i + 1} is {size:,} bytes, more than the {self.max_bytes:,} read per image; "
                    "send a smaller file"
                )


def open_image(source, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """An RGB image from a path, raw bytes or a Pillow image (an animation's first frame); InvalidSettingError in one
    line when the file is missing, is not a picture Pillow reads, is cut short, or holds more than `max_pixels`
    pixels (refused from its header, before its pixels are decoded: a small file may unpack to gigabytes)."""
    if isinstance(source, Image.Image):
        image = source
    else:
        name = "the image" if isinstance(source, (bytes, bytearray)) else str(source)
        if not isinstance(source, (bytes, bytearray)) and not Path(source).is_file():
            raise InvalidSettingError(f"no such image file: {source}; give the path of a PNG, JPEG, WebP or GIF file")
        try:
            image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidSettingError(
                    f"{name} is {width} x {height} pixels, more than the {max_pixels:,} read; send a smaller image"
                )
            image.seek(0)
            image.load()
        except Image.DecompressionBombError as e:  # Pillow's own limit, met before ours where the header is larger
            raise InvalidSettingError(f"{name} holds too many pixels ({e}); send a smaller image") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise InvalidSettingError(f"{name} is not a readable image ({e}); give a PNG, JPEG, WebP or GIF") from None
    return image.convert("RGB") if image.mode != "RGB" else image
