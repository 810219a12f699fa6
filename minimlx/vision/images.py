"""Picture files (PNG, JPEG, WebP, GIF: its first frame) decoded with Pillow into RGB images."""

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import InvalidSettingError

MAX_PIXELS = 8192 * 8192  # the largest picture read: its size comes from the file's header, before any decoding


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
