"""The text model of an image-text checkpoint (Gemma 3 and 4, Llama 4, Mistral 3): its config and its tensors.

Such a checkpoint nests the language model's config under `text_config` and its tensors under `language_model`
(transformers 4 and mlx-lm: `language_model.model.layers...`, transformers 5: `model.language_model.layers...`),
beside a vision tower and a projector into the text model's width. A family that reads images (`reads_images`)
names the towers' tensors itself; the others run the text model, the towers' tensors left out with one log line
saying so.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.ffn import ACTIVATIONS
from ..core.vision import VisionEncoder
from ..errors import CheckpointError
from .config import choice, number
from .names import NameMap

log = logging.getLogger("minimlx.archs")

TOWERS = (
    r"(^|\.)vision_tower\.",
    r"(^|\.)vision_model\.",
    r"(^|\.)visual\.",
    r"(^|\.)multi_modal_projector\.",
    r"(^|\.)embed_vision\.",
    r"(^|\.)audio_tower\.",
    r"(^|\.)embed_audio\.",
)


def text_config(config: dict, model_type: str, inherited: dict | None = None) -> dict:
    """The language model's config of an image-text `config`, with its `inherited` keys set by the outer config (as
    transformers' image-text model reads them from its own config), or else the defaults given; CheckpointError in one
    line when it has none."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(
            f"a {model_type} config needs its text_config (the language model's settings) as an object; "
            "fix the config, or point minimlx at a text-only checkpoint"
        )
    outer = {key: config[key] for key in (inherited or {}) if config.get(key) is not None}
    return {**text, **(inherited or {}), **outer}


def text_model_names(
    names: NameMap,
    bodies: tuple[str, ...] = ("language_model.model.", "model.language_model."),
    heads: tuple[str, ...] = ("language_model.", ""),
) -> NameMap:
    """`names` (a text model's map, `model.`-prefixed) read with the text model's body under any of `bodies` and its
    head under any of `heads` (the image-text layouts), the towers dropped."""
    pairs = [
        (prefix + theirs.removeprefix("model."), ours)
        for prefix in bodies
        for theirs, ours in names.templates
        if theirs.startswith("model.")
    ]
    pairs += [
        (prefix + theirs, ours)
        for prefix in heads
        for theirs, ours in names.templates
        if not theirs.startswith("model.")
    ]
    return NameMap(pairs, drop=[*names.drop_patterns, *TOWERS])


def with_vision_names(text: NameMap, tower_prefixes, tower, projector, drop=()) -> NameMap:
    """`text` (a text model's map under the image-text layouts, `text_model_names`) reading a vision tower too: the
    `tower` pairs (theirs, ours) under each of `tower_prefixes`, the `projector` pairs bare and under `model.`
    (transformers 5's own names); `drop`: patterns of the towers' tensors left out."""
    towers = [(prefix + theirs, ours) for prefix in tower_prefixes for theirs, ours in tower]
    projectors = [(prefix + theirs, ours) for prefix in ("", "model.") for theirs, ours in projector]
    kept = [d for d in text.drop_patterns if d not in TOWERS]
    return NameMap(towers + projectors + text.templates, drop=[*kept, *drop])


class ImageText:
    """Put before a text family's plugin in the bases of its image-text plugin: the config read from `text_config`
    (with the outer config's `inherited` keys), the tensors from under `language_model`, the towers' left out."""

    image_text_type = ""  # the image-text checkpoints' model_type, for messages
    inherited = {}  # keys the outer config sets for the text model, with their values where it does not
    reads_images = False  # whether the plugin reads the vision tower (its `names` map the towers' tensors)

    @classmethod
    def from_config(cls, config: dict):
        return super().from_config(text_config(config, cls.image_text_type, cls.inherited))

    def convert_weights(self, weights: dict) -> dict:
        towers = {k: v for k, v in weights.items() if k not in NameMap([], drop=list(TOWERS)).to_ours({k: v})}
        skipped = len(towers) - len(self.names.to_ours(towers))
        if skipped:
            read = "the text model and its vision tower are" if self.reads_images else "the text model is"
            which = "other towers'" if self.reads_images else "towers' (vision, audio)"
            log.warning("%s: %s read; its %s %d tensors are skipped", self.image_text_type, read, which, skipped)
        return super().convert_weights(weights)


# A SigLIP tower's tensors (transformers' names, under a family's prefix) and ours under `vision.encoder.`.
SIGLIP_NAMES = [
    ("embeddings.patch_embedding.", "embed.proj."),
    ("embeddings.position_embedding.", "embed.position_embedding."),
    ("encoder.layers.{i}.layer_norm1.", "layers.{i}.attn_norm."),
    ("encoder.layers.{i}.layer_norm2.", "layers.{i}.ffn_norm."),
    ("encoder.layers.{i}.self_attn.out_proj.", "layers.{i}.attn.o_proj."),
    ("encoder.layers.{i}.self_attn.", "layers.{i}.attn."),
    ("encoder.layers.{i}.mlp.fc1.", "layers.{i}.ffn.up_proj."),
    ("encoder.layers.{i}.mlp.fc2.", "layers.{i}.ffn.down_proj."),
    ("post_layernorm.", "norm."),
]


def siglip_names(*prefixes: str) -> list[tuple[str, str]]:
    """A SigLIP tower's tensors under each of `prefixes` (the first is the one written), onto ours under
    `vision.encoder.`."""
    return [(prefix + theirs, f"vision.encoder.{ours}") for prefix in prefixes for theirs, ours in SIGLIP_NAMES]


@dataclass(frozen=True)
class VisionSettings:
    """A SigLIP encoder's sizes (a `vision_config`) and its projector's soft tokens per image (or per tile)."""

    dims: int
    ffn_dims: int
    layers: int
    heads: int
    image_size: int
    patch: int
    channels: int
    eps: float
    activation: str
    tokens: int  # soft tokens per image

    @classmethod
    def from_config(cls, vision: dict, tokens: int) -> "VisionSettings":
        return cls(
            dims=number(vision, "hidden_size"),
            ffn_dims=number(vision, "intermediate_size"),
            layers=number(vision, "num_hidden_layers"),
            heads=number(vision, "num_attention_heads"),
            image_size=number(vision, "image_size"),
            patch=number(vision, "patch_size"),
            channels=number(vision, "num_channels", 3),
            eps=number(vision, "layer_norm_eps", 1e-6, float),
            activation=choice(vision, "hidden_act", "gelu_pytorch_tanh", ACTIVATIONS),
            tokens=tokens,
        )

    def encoder(self) -> VisionEncoder:
        return VisionEncoder(
            self.dims,
            self.ffn_dims,
            self.layers,
            self.heads,
            self.image_size,
            self.patch,
            self.channels,
            self.eps,
            self.activation,
        )


def flattened_kernel(weights: dict, name: str) -> dict:
    """`weights` with the patch embedding's convolution kernel `name` (out, in, *window) flattened to the
    (out, features) matrix of the matmul it is (a stride-window convolution over whole patches)."""
    if name in weights and weights[name].ndim > 2:
        weights = {**weights, name: weights[name].reshape(weights[name].shape[0], -1)}
    return weights


def vocabulary_ids(metadata: dict, tokens: Sequence[str], family: str) -> list[int]:
    """The ids of `tokens` in a GGUF text file's vocabulary (its `metadata`), looked up by their texts (how an mmproj
    reader finds the image tokens of the text file it goes with); one line naming those missing otherwise."""
    vocabulary = {token: i for i, token in reversed(list(enumerate(metadata.get("tokenizer.ggml.tokens") or ())))}
    missing = [t for t in tokens if t not in vocabulary]
    if missing:
        raise CheckpointError(f"the text file's vocabulary lacks {', '.join(missing)}: it is not {family}'s")
    return [vocabulary[t] for t in tokens]


def shaped_kernel(weights: dict, name: str, shape: tuple[int, ...]) -> dict:
    """`weights` with the flattened kernel `name` back in the convolution's `shape` (as checkpoints store it)."""
    return {**weights, name: weights[name].reshape(shape)} if name in weights else weights


def write_out_images(ids: list[int], images: Sequence, placeholder: int, layout: Callable) -> list[int]:
    """`ids` with each `placeholder` (as a chat template writes one per image, side by side where no text comes
    between) replaced by the ids `layout(image)` of its image, image after image, as a processor that writes each
    image's places does; an image already written out (its whole layout) is kept and counted, placeholders past the
    last image left as they are."""
    layouts = [layout(image) for image in images]
    out, image, i = [], 0, 0
    while i < len(ids):
        written = layouts[image] if image < len(layouts) else None
        if written is not None and ids[i] == written[0] and ids[i : i + len(written)] == written:
            out.extend(written)
            i, image = i + len(written), image + 1
        elif written is not None and ids[i] == placeholder:
            out.extend(written)
            i, image = i + 1, image + 1
        else:
            out.append(ids[i])
            i += 1
    return out
