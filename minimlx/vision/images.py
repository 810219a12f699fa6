"""Picture files (PNG, JPEG, WebP, GIF: its first frame) decoded with Pillow into RGB images."""

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import InvalidSettingError


def open_image(source) -> Image.Image:
    """An RGB image from a path, raw bytes or a Pillow image (an animation's first frame); InvalidSettingError in one
    line when the file is missing or is not a picture Pillow reads."""
    if isinstance(source, Image.Image):
        image = source
    else:
        name = "the image bytes" if isinstance(source, (bytes, bytearray)) else str(source)
        if not isinstance(source, (bytes, bytearray)) and not Path(source).is_file():
            raise InvalidSettingError(f"no such image file: {source}; give the path of a PNG, JPEG, WebP or GIF file")
        try:
            image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
            image.seek(0)
            image.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise InvalidSettingError(f"{name} is not a readable image ({e}); give a PNG, JPEG, WebP or GIF") from None
    return image.convert("RGB") if image.mode != "RGB" else image
