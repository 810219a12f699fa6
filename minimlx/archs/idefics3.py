"""Idefics3 and SmolVLM: a SigLIP tower whose patch grid is pixel-shuffled into a LLaMA-shaped text model.

Each picture is cut into square tiles plus the whole picture shrunk to one tile (`minimlx.vision.TiledImages`); the
SigLIP encoder reads each tile (patch embedding, LayerNorm blocks, a final LayerNorm), the connector concatenates
each `scale_factor` x `scale_factor` square of patch vectors into one (the pixel shuffle) and projects it to the text
model's width. A tile's soft tokens stand at a run of `image_token_id`, and the processor writes the runs of one
picture between tokens of its own: for a grid of rows x columns, each tile as `<fake_token_around_image>
<row_r_col_c>` and its run, a newline after each row (two after the last), then the global image as
`<fake_token_around_image><global-img>`, its run and `<fake_token_around_image>`; a picture left whole is the
global image alone. The text model is causal over all of it (no both-ways attention).

The checkpoints name the towers `model.vision_model.*` and `model.connector.*` and the text model
`model.text_model.*` beside `lm_head` (transformers 4 and 5 alike); mlx-vlm's folders drop the `model.` prefix and
keep the text model under `language_model.` (its head as `language_model.lm_head`), with the patch kernel stored
channels-last.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..core.vision import FixedSizeImageEncoder, PixelShuffleProjector
from ..errors import CheckpointError, InvalidSettingError
from .config import number
from .image_text import (
    TOWERS,
    ImageText,
    VisionSettings,
    flattened_kernel,
    shaped_kernel,
    siglip_names,
    text_model_names,
)
from .llama3 import Llama3Config
from .names import LLAMA_NAMES, NameMap
from .registry import register

FAKE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<global-img>"
PATCH_KERNEL = "vision.encoder.embed.proj.weight"


def idefics3_names() -> NameMap:
    text = text_model_names(LLAMA_NAMES, bodies=("model.text_model.", "language_model."), heads=("", "language_model."))
    tower = siglip_names("model.vision_model.", "vision_model.")
    connector = [
        (prefix + "connector.modality_projection.proj.", "vision.projector.proj.") for prefix in ("model.", "")
    ]
    return NameMap(tower + connector + text.templates, drop=[d for d in text.drop_patterns if d not in TOWERS])


@register("idefics3", "smolvlm")
@dataclass
class Idefics3Config(ImageText, Llama3Config):
    """Idefics3's and SmolVLM's image-text checkpoints: the LLaMA-shaped text model and, with a `vision_config`, the
    SigLIP tower and pixel-shuffle connector whose soft tokens stand at `image_token`'s runs, a run per tile."""

    example_config = {
        "model_type": "idefics3",
        "text_config": Llama3Config.example_config,
        "vision_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 7,
        },
        "image_token_id": 63,
    }
    names = idefics3_names()
    image_text_type = "idefics3"
    inherited = {"tie_word_embeddings": False}
    reads_images = True

    vision: VisionSettings | None = None
    scale: int = 2  # the pixel shuffle's square side
    image_token: int = 128257
    image_start_token: int = 128257  # the prompt's `<image>`, which the processor writes out
    spell: Callable[[str], list[int]] | None = field(default=None, compare=False, repr=False)  # the tokenizer's ids

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return arch
        scale = number(config, "scale_factor", 2)
        side = number(vision, "image_size") // number(vision, "patch_size")
        if side % scale:
            raise CheckpointError(
                f"a tile's {side} x {side} patches do not split into squares of {scale} (scale_factor)"
            )
        image_token = number(config, "image_token_id", 128257)
        return replace(
            arch,
            vision=VisionSettings.from_config(vision, (side // scale) ** 2),
            scale=scale,
            image_token=image_token,
            image_start_token=image_token,
        )

    def image_encoder(self) -> FixedSizeImageEncoder | None:
        v = self.vision
        if v is None:
            return None
        return FixedSizeImageEncoder(v.encoder(), PixelShuffleProjector(v.dims, self.dims, self.scale))

    def image_processor(self, settings: dict):
        from ..vision import TiledImages

        processor = TiledImages.from_config(settings)
        if processor.tile != self.vision.image_size:
            raise CheckpointError(
                f"the image processor's tiles are {processor.tile} pixels but the vision tower reads "
                f"{self.vision.image_size}; set max_image_size.longest_edge to {self.vision.image_size}"
            )
        return processor

    def image_runs(self, image) -> tuple[int, ...]:
        rows, cols = image.grid
        return (self.vision.tokens,) * (rows * cols + 1)

    def image_places(self, image) -> int:
        return sum(self.image_runs(image))

    def with_tokenizer(self, tokenizer) -> "Idefics3Config":
        return replace(self, spell=lambda text: tokenizer.encode(text, add_special_tokens=False))

    def image_layout(self, rows: int, cols: int) -> list[int]:
        """The ids the processor writes for a picture of rows x cols tiles (0 x 0: left whole)."""
        if self.spell is None:
            raise InvalidSettingError(
                "writing an Idefics3 image's places needs its tokenizer: load the model with load"
            )
        run, fake = [self.image_token] * self.vision.tokens, self.spell(FAKE_TOKEN)
        out = []
        for r in range(rows):
            for c in range(cols):
                out += fake + self.spell(f"<row_{r + 1}_col_{c + 1}>") + run
            out += self.spell("\n" if r + 1 < rows else "\n\n")
        return out + fake + self.spell(GLOBAL_TOKEN) + run + fake

    def expand_images(self, ids: list[int], images: Sequence = ()) -> list[int]:
        """A prompt's ids with each image token (the prompt's `<image>`) written out as its picture's tiles and global
        image, as the processor writes them; a tile's run already written out (after its fake token and row or
        global token) is kept."""
        out, pictures, token, i = [], iter(images), self.image_token, 0
        while i < len(ids):
            if ids[i] != token:
                out.append(ids[i])
                i += 1
            elif i >= 2 and self.spell is not None and ids[i - 2 : i - 1] == self.spell(FAKE_TOKEN)[-1:]:
                written = i
                while written < min(len(ids), i + self.vision.tokens) and ids[written] == token:
                    written += 1
                out += ids[i:written]
                i = written
            else:
                picture = next(pictures, None)
                out += [token] if picture is None else self.image_layout(*picture.grid)
                i += 1
        return out

    def convert_weights(self, weights: dict) -> dict:
        """The text model's and the towers' tensors; the patch embedding's kernel flattened, channels first (mlx-vlm
        stores it (dims, p, p, channels))."""
        weights = super().convert_weights(weights)
        kernel, v = weights.get(PATCH_KERNEL), self.vision
        if kernel is not None and kernel.ndim == 4 and kernel.shape[-1] == v.channels != kernel.shape[1]:
            weights = {**weights, PATCH_KERNEL: kernel.transpose(0, 3, 1, 2)}
        return flattened_kernel(weights, PATCH_KERNEL)

    def export_weights(self, weights: dict) -> dict:
        v = self.vision
        shape = (v.dims, v.channels, v.patch, v.patch) if v is not None else ()
        return super().export_weights(shaped_kernel(weights, PATCH_KERNEL, shape))
