"""A picture in the explainer: read once for an image-text model, put into every prompt walked (its start token before
the prompt's text, unless the prompt writes it), its soft tokens placed in each pass; and what the image panel draws:
the picture, its encoder's patches and its soft tokens' grid over it, and where those tokens stand in the
prompt (the panel's heatmap is a chosen token's attention to them, read from the walk's attention weights). The
family says what grids its images make (`image_grids`): Gemma 3's and Gemma 4's pooled grids, Qwen's merged ones."""

import base64
import io
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..core.vision import ImageInput, PlacedImages
from ..decode.images import image_runs
from ..errors import InvalidSettingError
from ..vision import open_image


@dataclass(eq=False)
class ExplainedImage:
    """One picture for `model`: `image` as its processor prepared it and its soft tokens `features` (places, dims);
    `shown` the picture (a PNG data URL, at most 768 pixels a side), `patches` and `grid` its encoder's patches and
    its soft tokens as (rows, columns) over it."""

    model: nn.Module
    image: ImageInput
    features: mx.array
    start_text: str
    shown: str
    size: tuple[int, int]  # (width, height) of the picture shown
    patches: tuple[int, int]
    grid: tuple[int, int]

    @classmethod
    def read(cls, model: nn.Module, tokenizer, source) -> "ExplainedImage":
        """`source` (a path, bytes or a Pillow image) for `model`; one line when the model reads no images, its
        images make no grid the panel draws, or the picture cannot be read."""
        if "vision" not in model:
            raise InvalidSettingError(
                "this model reads text only; --image needs an image-text model (Gemma 3 or 4, Qwen2.5-VL, Qwen3-VL)"
            )
        if model.image_processor is None:
            raise InvalidSettingError("the model has no image processor: put its preprocessor_config.json beside it")
        picture = open_image(source)
        (image,) = model.image_processor([picture])
        grids = model.config.image_grids(image)
        if grids is None:
            kind = type(model.config).__name__
            raise InvalidSettingError(
                f"the explainer's image panel draws one run of soft tokens on a grid per picture; {kind}'s images "
                "make none (tiles, or rows split by break tokens): pick a Gemma or Qwen image-text model"
            )
        features = model.encode_images([image])
        mx.eval(features)
        picture = picture.copy()
        picture.thumbnail((768, 768))
        png = io.BytesIO()
        picture.save(png, "PNG")
        shown = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        start_text = tokenizer.decode([model.config.image_start_token])
        return cls(model, image, features, start_text, shown, picture.size, *grids)

    @property
    def tokens(self) -> int:
        return self.features.shape[0]

    def prompt(self, text: str) -> str:
        """`text` with the image's start token before it, unless it writes the token itself."""
        return text if self.start_text in text else self.start_text + text

    def written(self, text: str) -> str:
        """A prompt's text (after its chat template) with the image's place written out as the model's processor
        writes it (`write_images_text`)."""
        return self.model.config.write_images_text(text)

    def ids(self, ids: list[int], limit: int) -> list[int]:
        """A prompt's ids with the image's places written out (`expand_images`), holding exactly this one image; one
        line when they hold another number of images or, written out, more than `limit` tokens besides the image's."""
        config = self.model.config
        ids = config.expand_images(list(ids), [self.image])
        runs = image_runs(ids, config.image_token)
        if [stop - start for start, stop in runs] != list(config.image_runs(self.image)):
            raise InvalidSettingError(
                f"the prompt holds {len(runs)} image(s); the walk shows one image: write the image token once"
            )
        if len(ids) - self.tokens > limit:
            raise InvalidSettingError(
                f"the prompt has {len(ids) - self.tokens} tokens besides the image's; the walk shows at most {limit}"
            )
        if runs[-1][1] >= len(ids):
            raise InvalidSettingError("the prompt ends inside the image's places; write text after the image")
        return ids

    def placed(self, ids: list[int]) -> PlacedImages:
        """The soft tokens in place in `ids` (as `ids` wrote them out)."""
        config = self.model.config
        axes = config.image_axes(ids, [self.image])
        return config.place_images(ids, self.features, [self.tokens], axes)

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
