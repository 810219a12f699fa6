"""Images in request bodies: OpenAI's `image_url` and Responses' `input_image` parts (data URLs), Anthropic's `image`
blocks and Ollama's `images` (base64), read into bytes in the order they come, each one's place marked in its
message's text (`IMAGE_PLACE`) until the model's image token replaces the mark (`Renderer`).

An http(s) URL is kept as an `ImageURL` until the request's model starts it: a server started with
`--allow-image-urls` then fetches it (`ImageFetcher`: a size and a time limit, http and https alone, redirects
included), any other refuses it with a pointer to data URLs. Whether the bytes are a picture, and one of a size the
server reads, `PromptImages.read` checks (from the file's header, before decoding).
"""

import base64
import binascii
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from .fields import APIError, bad

IMAGE_PLACE = "\ue000"  # a private-use character: where an image goes in a message's text
IMAGE_PARTS = ("image_url", "input_image", "image")  # OpenAI chat's, Responses', Anthropic's
DATA_URL = "data:image/png;base64,..."


@dataclass(frozen=True)
class ImageURL:
    """An http(s) image URL of a request, and the field it came in (`param`), fetched (or refused) when the request
    starts."""

    url: str
    param: str


def content_with_images(content, param: str, images: list, kinds=("text", "input_text", "output_text")) -> str:
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


def image_part(part: dict, param: str) -> "bytes | ImageURL":
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


def url_bytes(url, param: str) -> "bytes | ImageURL":
    """The bytes of a base64 data URL; an http(s) URL as an `ImageURL` (fetched later, or refused); any other URL is
    refused."""
    if not isinstance(url, str):
        raise bad(param, f"'{param}' must be an image's data URL ({DATA_URL})")
    if url.startswith("data:"):
        header, comma, data = url[len("data:") :].partition(",")
        if not comma or not header.endswith(";base64"):
            raise bad(param, f"'{param}' must be a base64 data URL ({DATA_URL})")
        return base64_bytes(data, param)
    if url.startswith(("http://", "https://")):
        return ImageURL(url, param)
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


NOT_FETCHED = f"this server does not fetch image URLs; send the image inline as a data URL ({DATA_URL})"


class HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed to http(s) addresses alone (urllib's own follows ftp too)."""

    def http_error_302(self, req, fp, code, msg, headers):
        target = urllib.parse.urljoin(req.full_url, headers.get("location") or headers.get("uri") or "")
        if not target.startswith(("http://", "https://")):
            raise urllib.error.URLError(f"it redirects to {target[:60]!r}, not an http(s) URL")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


@dataclass(frozen=True)
class ImageFetcher:
    """Fetches http(s) image URLs for `serve --allow-image-urls`: at most `max_bytes` (refused 413 from the
    Content-Length or as soon as the body passes it) within `timeout` seconds in all (connecting and reading)."""

    max_bytes: int = 20_000_000
    timeout: float = 10.0
    CHUNK = 1 << 16

    def fetch(self, image: ImageURL) -> bytes:
        """The URL's bytes; an APIError (400, or 413 when too large) in one line when it cannot be had in time. The
        download runs on a thread of its own, waited for `timeout` at most: a name lookup that hangs (which no socket
        timeout bounds) is left behind, not waited for."""
        outcome = queue.SimpleQueue()
        threading.Thread(target=lambda: outcome.put(self.attempt(image)), daemon=True).start()
        try:
            result = outcome.get(timeout=self.timeout + 0.05)  # the download's own deadline answers first
        except queue.Empty:
            result = self.slow(image)
        if isinstance(result, APIError):
            raise result
        return result

    def attempt(self, image: ImageURL) -> "bytes | APIError":
        try:
            return self.download(image)
        except APIError as e:
            return e

    def slow(self, image: ImageURL) -> APIError:
        message = f"fetching the image at {image.url[:80]} took more than {self.timeout:g} s; send it as a data URL"
        return bad(image.param, f"{message} ({DATA_URL})")

    def download(self, image: ImageURL) -> bytes:
        """`fetch` on this thread, its deadline looked at between reads."""
        deadline, url, param = time.monotonic() + self.timeout, image.url, image.param
        opener = urllib.request.build_opener(HttpOnlyRedirects)
        request = urllib.request.Request(url, headers={"User-Agent": "minimlx", "Accept": "image/*"})
        try:
            with opener.open(request, timeout=self.timeout) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise self.too_large(url, param)
                body = bytearray()
                while chunk := response.read1(self.CHUNK):  # what one read brings: the deadline is looked at
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise self.too_large(url, param)
                    if time.monotonic() > deadline:
                        raise TimeoutError
                return bytes(body)
        except urllib.error.HTTPError as e:
            raise bad(param, f"fetching the image at {url[:80]} gave HTTP {e.code}; send it as a data URL") from None
        except TimeoutError:
            raise self.slow(image) from None
        except (OSError, ValueError) as e:
            message = f"fetching the image at {url[:80]} failed ({reason(e)}); send it as a data URL ({DATA_URL})"
            raise bad(param, message) from None

    def too_large(self, url: str, param: str) -> APIError:
        message = (
            f"the image at {url[:80]} is larger than {self.max_bytes / 1e6:g} MB, the most fetched (--image-url-mb)"
        )
        return APIError(413, message, param, "request_too_large")


def reason(error: Exception) -> str:
    return str(getattr(error, "reason", None) or error)[:120]


def fetched(images: list, fetcher: ImageFetcher | None) -> list[bytes]:
    """The images' bytes, each `ImageURL` among them fetched by `fetcher` (refused where there is none)."""
    out = []
    for image in images:
        if isinstance(image, ImageURL):
            if fetcher is None:
                raise bad(image.param, NOT_FETCHED)
            image = fetcher.fetch(image)
        out.append(image)
    return out
