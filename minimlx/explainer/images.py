"""A picture in the explainer: read once for an image-text model, put into every prompt walked (its start token before
the prompt's text, unless the prompt writes it), its soft tokens placed in each pass; and what the image panel draws:
the picture as the model sees it, its encoder's patches and its soft tokens' grid, and where those tokens stand in the
prompt (the panel's heatmap is a chosen token's attention to them, read from the walk's attention weights)."""

import base64
import io
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..core.vision import PlacedImages
from ..decode.images import image_runs
from ..errors import InvalidSettingError


@dataclass(eq=False)
class ExplainedImage:
    """One picture and its soft tokens `features` (1, tokens, dims) for `model`; `shown` the picture the model sees
    (a PNG data URL), `patches` and `grid` its encoder's patches and its soft tokens as (rows, columns)."""

    model: nn.Module
    features: mx.array
    start_text: str
    shown: str
    size: tuple[int, int]  # (width, height) of the picture the model sees
    patches: tuple[int, int]
    grid: tuple[int, int]

    @classmethod
    def read(cls, model: nn.Module, tokenizer, source) -> "ExplainedImage":
        """`source` (a path, bytes or a Pillow image) for `model`; one line when the model reads no images or the
        picture cannot be read."""
        if "vision" not in model:
            raise InvalidSettingError("this model reads text only; --image needs an image-text model (Gemma 3)")
        processor = model.image_processor
        if processor is None:
            raise InvalidSettingError("the model has no image processor: put its preprocessor_config.json beside it")
        picture = processor.resized(source)
        features = model.encode_images(mx.array(processor([picture])))
        mx.eval(features)
        png = io.BytesIO()
        picture.save(png, "PNG")
        shown = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        width, height = picture.size
        patch = model.vision.patch
        return cls(
            model,
            features,
            tokenizer.decode([model.config.image_start_token]),
            shown,
            picture.size,
            (height // patch, width // patch),
            model.vision.grid,
        )

    @property
    def tokens(self) -> int:
        return self.features.shape[1]

    def prompt(self, text: str) -> str:
        """`text` with the image's start token before it, unless it writes the token itself."""
        return text if self.start_text in text else self.start_text + text

    def ids(self, ids: list[int], limit: int) -> list[int]:
        """A prompt's ids with the image's places written out (`expand_images`), holding exactly this one image; one
        line when they hold another number of images or, written out, more than `limit` tokens besides the image's."""
        ids = self.model.config.expand_images(list(ids))
        runs = image_runs(ids, self.model.config.image_token)
        if len(runs) != 1 or runs[0][1] - runs[0][0] != self.tokens:
            raise InvalidSettingError(
                f"the prompt holds {len(runs)} image(s); the walk shows one image: write the image token once"
            )
        if len(ids) - self.tokens > limit:
            raise InvalidSettingError(
                f"the prompt has {len(ids) - self.tokens} tokens besides the image's; the walk shows at most {limit}"
            )
        if runs[0][1] >= len(ids):
            raise InvalidSettingError("the prompt ends inside the image's places; write text after the image")
        return ids

    def placed(self, ids: list[int]) -> PlacedImages:
        """The soft tokens in place in `ids` (as `ids` wrote them out)."""
        return PlacedImages.at(ids, self.model.config.image_token, self.features)

    def panel(self, ids: list[int]) -> dict:
        """What the image panel draws for the prompt `ids`: the picture, its grids, and the [start, stop) of its
        soft tokens among the prompt's positions (row-major over `grid`)."""
        (start, stop), *_ = image_runs(ids, self.model.config.image_token)
        width, height = self.size
        return {
            "src": self.shown,
            "width": width,
            "height": height,
            "patches": list(self.patches),
            "grid": list(self.grid),
            "start": start,
            "stop": stop,
        }


def placed(image: ExplainedImage | None, ids: list[int]) -> PlacedImages | None:
    return image.placed(ids) if image is not None else None
