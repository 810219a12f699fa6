"""Images in request bodies: OpenAI's `image_url` and Responses' `input_image` parts (data URLs), Anthropic's `image`
blocks and Ollama's `images` (base64), read into bytes in the order they come, each one's place marked in its
message's text (`IMAGE_PLACE`) until the model's image token replaces the mark (`Renderer`).

Remote URLs are refused: the server fetches nothing on a client's behalf. Whether the bytes are a picture, and one
of a size the server reads, `PromptImages.read` checks (from the file's header, before decoding).
"""

import base64
import binascii

from .fields import bad

IMAGE_PLACE = "\ue000"  # a private-use character: where an image goes in a message's text
IMAGE_PARTS = ("image_url", "input_image", "image")  # OpenAI chat's, Responses', Anthropic's
DATA_URL = "data:image/png;base64,..."


def content_with_images(content, param: str, images: list[bytes], kinds=("text", "input_text", "output_text")) -> str:
    """A message's text: a string, or a list of text and image parts, each image's bytes appended to `images` and its
    place marked in the text."""
    if isinstance(content, str):
        return content
    if not (isinstance(content, list) and all(isinstance(p, dict) for p in content)):
        raise bad(param, f"'{param}' must be a string or a list of text and image parts")
    texts = []
    for i, part in enumerate(content):
        kind, where = part.get("type", "text"), f"{param}[{i}]"
        if kind in IMAGE_PARTS:
            images.append(image_part(part, where))
            texts.append(IMAGE_PLACE)
        elif kind in kinds and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad(where, f"{where} must be a text part or an image part, not a '{kind}' part")
    return "".join(texts)


def image_part(part: dict, param: str) -> bytes:
    """The bytes of one image part: {"type": "image_url", "image_url": {"url"}} (OpenAI's chat; the URL alone too),
    {"type": "input_image", "image_url"} (Responses) or {"type": "image", "source": {"type": "base64", "data"}}
    (Anthropic's)."""
    kind = part["type"]
    if kind == "image":
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "base64":
            return base64_bytes(source.get("data"), f"{param}.source.data")
        if isinstance(source, dict) and source.get("type") == "url":
            return url_bytes(source.get("url"), f"{param}.source.url")
        raise bad(f"{param}.source", f'{param}.source must be {{"type": "base64", "media_type": ..., "data": ...}}')
    url = part.get("image_url")
    if kind == "image_url" and isinstance(url, dict):
        return url_bytes(url.get("url"), f"{param}.image_url.url")
    if kind == "input_image" and url is None and part.get("file_id") is not None:
        raise bad(f"{param}.file_id", f"this server stores no files; send the image as a data URL ({DATA_URL})")
    return url_bytes(url, f"{param}.image_url")


def url_bytes(url, param: str) -> bytes:
    """The bytes of a base64 data URL; any other URL is refused (this server fetches nothing)."""
    if not isinstance(url, str):
        raise bad(param, f"'{param}' must be an image's data URL ({DATA_URL})")
    if url.startswith("data:"):
        header, comma, data = url[len("data:") :].partition(",")
        if not comma or not header.endswith(";base64"):
            raise bad(param, f"'{param}' must be a base64 data URL ({DATA_URL})")
        return base64_bytes(data, param)
    if url.startswith(("http://", "https://")):
        raise bad(param, f"this server does not fetch image URLs; send the image inline as a data URL ({DATA_URL})")
    raise bad(param, f"'{param}' must be an image's data URL ({DATA_URL}), not {url[:40]!r}")


def base64_bytes(data, param: str) -> bytes:
    if not isinstance(data, str):
        raise bad(param, f"'{param}' must be the image's bytes in base64")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, f"'{param}' is not valid base64; send the image's bytes in base64") from None


def ollama_images(images, param: str, into: list[bytes]) -> str:
    """Ollama's `images` (a list of base64 strings) appended to `into`; their places, which go before the text."""
    if not isinstance(images, list):
        raise bad(param, f"'{param}' must be a list of base64 images")
    into += [base64_bytes(image, f"{param}[{i}]") for i, image in enumerate(images)]
    return IMAGE_PLACE * len(images)
