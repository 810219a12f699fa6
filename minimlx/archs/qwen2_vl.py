"""Qwen2-VL and Qwen2.5-VL: Qwen2's text model read with Qwen's multimodal RoPE, and a vision tower over pictures of
any size.

The image processor resizes each picture to whole merge blocks within a pixel budget and cuts it into patches
(`DynamicResolutionPatches`); the tower (`WindowedVisionEncoder`) embeds them, runs its blocks and merges each 2 x 2
block into one soft token. Qwen2.5-VL's blocks are RMSNorm and gated-FFN ones attending within windows of merge
blocks except in `fullatt_block_indexes`; Qwen2-VL's are LayerNorm and QuickGELU-MLP ones over the whole picture.
In the prompt an image is `<|vision_start|>`, one `<|image_pad|>` per soft token, `<|vision_end|>`.

Positions have three axes (time, row, column; `mrope_section` says which frequencies each turns): text tokens sit at
the same place along all three, one after another; an image's tokens at (start, start + row, start + column) of its
merged grid, and the text after it from start + max(rows, columns) on. Past the last image every position is its
index plus one shift per prompt, which the caches carry (`Cache.shift_positions`).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import mlx.core as mx
import numpy as np

from ..core.ffn import ACTIVATIONS, MLP, GatedFFN
from ..core.norms import LayerNorm, RMSNorm
from ..core.rope import MultimodalRoPE
from ..core.vision import ImageInput
from ..core.windowed_vision import (
    FlatPatchEmbedding,
    InterpolatedPositions,
    PatchMerger,
    RotaryEncoderBlock,
    WindowedVisionEncoder,
)
from ..errors import CheckpointError
from .config import choice, number
from .fused import fuse
from .gguf import Metadata, llama_config
from .image_text import flattened_kernel, shaped_kernel, vocabulary_ids
from .names import LLAMA_NAMES, NameMap
from .qwen2 import Qwen2Config
from .registry import register

TOWER_NAMES = [
    ("patch_embed.proj.", "embed.proj."),
    ("blocks.{i}.", "layers.{i}."),
    ("merger.ln_q.", "merger.norm."),
    ("merger.mlp.0.", "merger.up."),
    ("merger.mlp.2.", "merger.down."),
]
QWEN2_VL_MLP_NAMES = [
    ("blocks.{i}.mlp.fc1.", "layers.{i}.mlp.up_proj."),
    ("blocks.{i}.mlp.fc2.", "layers.{i}.mlp.down_proj."),
]


def qwen_vl_names(tower: list[tuple[str, str]]) -> NameMap:
    """The tower's names and the text model's: the published layout (written back by `convert`), transformers 5's
    in-memory one (`model.visual.`, `model.language_model.`) and mlx-vlm's (`vision_tower.`,
    `language_model.model.`, `language_model.lm_head.`)."""
    text = LLAMA_NAMES.templates
    return NameMap(
        [
            (prefix + theirs, "vision." + ours)
            for prefix in ("visual.", "model.visual.", "vision_tower.")
            for theirs, ours in tower
        ]
        + text
        + [("model.language_model." + t.removeprefix("model."), o) for t, o in text if t.startswith("model.")]
        + [("language_model." + t, o) for t, o in text],
        drop=LLAMA_NAMES.drop_patterns,
    )


TOWER_GGUF_NAMES = NameMap(
    [
        ("v.patch_embd.", "vision.embed.proj."),
        ("v.blk.{i}.ln1.", "vision.layers.{i}.norm1."),
        ("v.blk.{i}.ln2.", "vision.layers.{i}.norm2."),
        ("v.blk.{i}.attn_q.", "vision.layers.{i}.attn.q."),
        ("v.blk.{i}.attn_k.", "vision.layers.{i}.attn.k."),
        ("v.blk.{i}.attn_v.", "vision.layers.{i}.attn.v."),
        ("v.blk.{i}.attn_out.", "vision.layers.{i}.attn.proj."),
        ("v.blk.{i}.ffn_gate.", "vision.layers.{i}.mlp.gate_proj."),
        ("v.blk.{i}.ffn_up.", "vision.layers.{i}.mlp.up_proj."),
        ("v.blk.{i}.ffn_down.", "vision.layers.{i}.mlp.down_proj."),
        ("v.post_ln.", "vision.merger.norm."),
        ("mm.0.", "vision.merger.up."),
        ("mm.2.", "vision.merger.down."),
    ]
)  # llama.cpp's mmproj names of the tower: q, k and v split, the patch kernel one 2D kernel per frame (`.weight.1`)
IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # their texts in Qwen's vocabulary


@dataclass(frozen=True)
class WindowedTowerSettings:
    """The vision tower's sizes (Qwen2.5-VL's `vision_config`, or Qwen2-VL's: `qwen2_vl`)."""

    dims: int
    ffn_dims: int
    layers: int
    heads: int
    out_dims: int
    patch: int
    frames: int
    merge: int
    window: int | None  # pixels a window's side spans (None: every block sees the whole picture)
    full_layers: tuple[int, ...]
    channels: int
    activation: str
    rope_base: float
    gated: bool = True  # RMSNorm and gated-FFN blocks (Qwen2.5-VL), else LayerNorm and MLP ones (Qwen2-VL)
    positions: int = 0  # learned positions resampled to each grid (Qwen3-VL's table of this many), else none
    deepstack_layers: tuple[int, ...] = ()  # the blocks whose outputs are DeepStack's levels (Qwen3-VL)

    @classmethod
    def from_config(cls, v: dict) -> "WindowedTowerSettings":
        rope = v.get("rope_parameters") or {}
        return cls(
            dims=number(v, "hidden_size"),
            ffn_dims=number(v, "intermediate_size"),
            layers=number(v, "depth"),
            heads=number(v, "num_heads"),
            out_dims=number(v, "out_hidden_size"),
            patch=number(v, "patch_size", 14),
            frames=number(v, "temporal_patch_size", 2),
            merge=number(v, "spatial_merge_size", 2),
            window=number(v, "window_size", 112),
            full_layers=tuple(v.get("fullatt_block_indexes") or ()),
            channels=number(v, "in_channels", 3),
            activation=choice(v, "hidden_act", "silu", ACTIVATIONS),
            rope_base=float(rope.get("rope_theta", 10000.0)),
        )

    @classmethod
    def qwen3_vl(cls, v: dict) -> "WindowedTowerSettings":
        """Qwen3-VL's and Qwen3.5's `vision_config`: LayerNorm and MLP blocks over the whole picture, learned
        positions, DeepStack levels from `deepstack_visual_indexes` (none in Qwen3.5)."""
        return replace(
            cls.from_config(v),
            window=None,
            full_layers=(),
            activation=choice(v, "hidden_act", "gelu_pytorch_tanh", ACTIVATIONS),
            gated=False,
            positions=number(v, "num_position_embeddings"),
            deepstack_layers=tuple(v.get("deepstack_visual_indexes") or ()),
        )

    @classmethod
    def qwen2_vl(cls, v: dict) -> "WindowedTowerSettings":
        """Qwen2-VL's `vision_config`: its width is `embed_dim`, its output `hidden_size`, its FFN `mlp_ratio` wide."""
        dims = number(v, "embed_dim")
        return cls(
            dims=dims,
            ffn_dims=int(dims * number(v, "mlp_ratio", 4, float)),
            layers=number(v, "depth"),
            heads=number(v, "num_heads"),
            out_dims=number(v, "hidden_size"),
            patch=number(v, "patch_size", 14),
            frames=number(v, "temporal_patch_size", 2),
            merge=number(v, "spatial_merge_size", 2),
            window=None,
            full_layers=(),
            channels=number(v, "in_channels", 3),
            activation=choice(v, "hidden_act", "quick_gelu", ACTIVATIONS),
            rope_base=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            gated=False,
        )


@dataclass
class QwenImages:
    """Put before a Qwen text family's plugin in the bases of its image-text plugin (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
    Qwen3.5): the text model read from `text_config` (transformers 5) or the top level (the published Qwen2.5-VL
    configs), the tower from `vision_config` (`tower_settings`), Qwen's image tokens, dynamic-resolution processor and
    multimodal RoPE (its frequencies `interleaved` among the axes in Qwen3-VL and Qwen3.5)."""

    vision: WindowedTowerSettings | None = None
    mrope_sections: tuple[int, ...] = ()
    image_token: int = 151655
    image_start_token: int = 151652
    image_end_token: int = 151653
    mrope_interleaved: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: dict):
        text = config.get("text_config")
        outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        arch = super().from_config({**outer, **text} if isinstance(text, dict) else outer)
        sections = (text if isinstance(text, dict) else config).get("mrope_section")
        vision = config.get("vision_config")
        wanted = sections is not None or isinstance(vision, dict)  # a text-only checkpoint may turn positions plainly
        if wanted and (not isinstance(sections, list) or len(sections) != 3):
            raise CheckpointError(
                f"a {config.get('model_type')} config needs rope_parameters.mrope_section (three numbers); fix the "
                "config"
            )
        return replace(
            arch,
            vision=cls.tower_settings(vision) if isinstance(vision, dict) else None,
            mrope_sections=tuple(int(n) for n in sections or ()),
            image_token=number(config, "image_token_id", cls.image_token),
            image_start_token=number(config, "vision_start_token_id", cls.image_start_token),
            image_end_token=number(config, "vision_end_token_id", cls.image_end_token),
        )

    @staticmethod
    def tower_settings(vision: dict) -> WindowedTowerSettings:
        return WindowedTowerSettings.from_config(vision)

    def rope(self, layer: int) -> MultimodalRoPE:
        """Layer `layer`'s multimodal RoPE (the text model's plain one where the config gives no sections: a checkpoint
        read as text only)."""
        if not self.mrope_sections:
            return super().rope(layer)
        return MultimodalRoPE(
            self.rotary_dims, self.rope_base, self.mrope_sections, self.max_positions, self.mrope_interleaved
        )

    def image_encoder(self) -> WindowedVisionEncoder | None:
        v = self.vision
        if v is None:
            return None

        def norm(dims=v.dims):
            return RMSNorm(dims, 1e-6) if v.gated else LayerNorm(dims, 1e-6)

        def ffn():
            return (
                GatedFFN(v.dims, v.ffn_dims, v.activation, bias=True)
                if v.gated
                else MLP(v.dims, v.ffn_dims, v.activation)
            )

        layers = [RotaryEncoderBlock(v.dims, v.heads, norm(), norm(), ffn()) for _ in range(v.layers)]
        joined = v.dims * v.merge * v.merge
        return WindowedVisionEncoder(
            FlatPatchEmbedding(v.channels * v.frames * v.patch * v.patch, v.dims, bias=v.positions > 0),
            layers,
            PatchMerger(v.dims, v.out_dims, v.merge, norm()),
            v.dims // v.heads,
            v.merge,
            None if v.window is None else v.window // v.merge // v.patch,
            v.full_layers,
            v.rope_base,
            positions=InterpolatedPositions(math.isqrt(v.positions), v.dims) if v.positions else None,
            deepstack=[PatchMerger(v.dims, v.out_dims, v.merge, norm(joined), True) for _ in v.deepstack_layers],
            deepstack_layers=v.deepstack_layers,
        )

    def image_processor(self, settings: dict):
        from ..vision.patches import DynamicResolutionPatches

        return DynamicResolutionPatches.from_config(settings)

    def image_places(self, image: ImageInput) -> int:
        frames, rows, cols = image.grid
        return frames * rows * cols // self.vision.merge**2

    def image_grids(self, image: ImageInput) -> tuple[tuple[int, int], tuple[int, int]]:
        """The picture's patches and its merged soft tokens, both row-major over it."""
        _, rows, cols = image.grid
        return (rows, cols), (rows // self.vision.merge, cols // self.vision.merge)

    def expand_images(self, ids: list[int], images: Sequence[ImageInput] = ()) -> list[int]:
        """Each `<|vision_start|>` followed by its image's `<|image_pad|>` places and `<|vision_end|>` (a single pad
        after it, as Qwen's chat template writes one, stands for them all), image after image."""
        out, i, image = [], 0, 0
        while i < len(ids):
            out.append(ids[i])
            i += 1
            if out[-1] != self.image_start_token or image >= len(images):
                continue
            while i < len(ids) and ids[i] == self.image_token:
                i += 1
            out += [self.image_token] * self.image_places(images[image])
            if i >= len(ids) or ids[i] != self.image_end_token:
                out.append(self.image_end_token)
            image += 1
        return out

    def image_axes(self, ids: list[int], images: Sequence[ImageInput]) -> np.ndarray:
        """(3, tokens): each token's (time, row, column) position, as transformers' `get_rope_index` gives them for
        pictures (one frame each)."""
        axes, at, image, i = [], 0, 0, 0
        while i < len(ids):
            if ids[i] != self.image_token:
                axes.append(np.full((3, 1), at))
                at, i = at + 1, i + 1
                continue
            _, rows, cols = images[image].grid
            rows, cols = rows // self.vision.merge, cols // self.vision.merge
            r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            axes.append(at + np.stack([np.zeros(rows * cols, int), r.reshape(-1), c.reshape(-1)]))
            at, i, image = at + max(rows, cols), i + rows * cols, image + 1
        return np.concatenate(axes, axis=1)

    def convert_weights(self, weights: dict) -> dict:
        """The text model's and the tower's tensors; the patch embedding's kernel, (dims, channels, frames, p, p) as
        torch writes it or (dims, frames, p, p, channels) as mlx-vlm does, flattened in (channel, frame, row, column)
        order."""
        weights, name, v = super().convert_weights(weights), "vision.embed.proj.weight", self.vision
        if v is not None and name in weights and weights[name].ndim == 5:
            torch_order, channels_last = (
                (v.channels, v.frames, v.patch, v.patch),
                (v.frames, v.patch, v.patch, v.channels),
            )
            if weights[name].shape[1:] == channels_last != torch_order:
                weights[name] = weights[name].transpose(0, 4, 1, 2, 3)
        return flattened_kernel(weights, name)

    def export_weights(self, weights: dict) -> dict:
        v = self.vision
        shape = (v.dims, v.channels, v.frames, v.patch, v.patch) if v is not None else ()
        return super().export_weights(shaped_kernel(weights, "vision.embed.proj.weight", shape))


@register("qwen2_5_vl")
@dataclass
class Qwen25VLConfig(QwenImages, Qwen2Config):
    """Qwen2.5-VL: Qwen2's text model; a tower of RMSNorm and gated-FFN blocks attending within windows."""

    example_config = {
        "model_type": "qwen2_5_vl",
        "text_config": {
            **Qwen2Config.example_config,
            "rope_parameters": {"rope_theta": 1e4, "mrope_section": [2, 1, 1]},
        },
    }
    names = qwen_vl_names(TOWER_NAMES)
    gguf_architectures = ("qwen2vl",)  # llama.cpp's text files of Qwen2-VL and Qwen2.5-VL
    mmproj_projectors = ("qwen2.5vl_merger",)  # llama.cpp's clip.projector_type of the mmproj files it reads
    mmproj_text = ("qwen2vl",)
    mmproj_model_type = "qwen2_5_vl"  # the model_type of the image-text config an mmproj file makes

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """A llama.cpp `qwen2vl` text file: llama.cpp's LLaMA keys, the multimodal RoPE's sections from
        rope.dimension_sections (its fourth, 0, unused); the text model alone until an mmproj file adds the tower."""
        sections = Metadata(metadata)["rope.dimension_sections"]
        return {**llama_config(metadata, tensors, "qwen2_5_vl"), "mrope_section": list(sections[:3])}

    @classmethod
    def mmproj_config(cls, text: dict, text_metadata: dict, clip: dict, shapes: dict) -> dict:
        """The image-text config of a `qwen2vl` text file's config `text` and a llama.cpp mmproj file's metadata `clip`
        (`shapes`: its tensors' shapes, by name): the tower's sizes from its clip.vision keys, its full-attention blocks
        every n_wa_pattern-th (as llama.cpp runs them), windows of clip.vision.window_size pixels (112, llama.cpp's and
        every published checkpoint's, where the file has none); the image tokens' ids looked up in the text file's
        vocabulary."""
        m = Metadata(clip)
        start, end, pad = vocabulary_ids(text_metadata, IMAGE_TOKENS, "Qwen2-VL or Qwen2.5-VL")
        return {
            **text,
            "model_type": cls.mmproj_model_type,
            "vision_config": cls.mmproj_tower(m, shapes),
            "image_token_id": pad,
            "vision_start_token_id": start,
            "vision_end_token_id": end,
        }

    @staticmethod
    def mmproj_tower(m: Metadata, shapes: dict) -> dict:
        """Qwen2.5-VL's `vision_config` from an mmproj file's clip.vision keys."""
        layers, pattern = m["vision.block_count"], m["vision.n_wa_pattern"]
        return {
            "depth": layers,
            "hidden_size": m["vision.embedding_length"],
            "intermediate_size": m["vision.feed_forward_length"],
            "num_heads": m["vision.attention.head_count"],
            "out_hidden_size": m["vision.projection_dim"],
            "patch_size": m["vision.patch_size"],
            "spatial_merge_size": m.get("vision.spatial_merge_size", 2),
            "temporal_patch_size": 2,  # llama.cpp's converter splits the kernel of two frames into two
            "window_size": m.get("vision.window_size", 112),
            "fullatt_block_indexes": [i for i in range(layers) if (i + 1) % pattern == 0],
        }

    @classmethod
    def mmproj_processor(cls, clip: dict) -> dict:
        """The image processor's config an mmproj file's metadata gives: Qwen's dynamic resolution over its patch
        and merge sizes, bicubic, normalised by the file's mean and std, between 8 and 4096 soft tokens a picture
        (llama.cpp's limits) unless clip.vision.image_min_pixels / image_max_pixels say otherwise."""
        m = Metadata(clip)
        patch, merge = m["vision.patch_size"], m.get("vision.spatial_merge_size", 2)
        token = (patch * merge) ** 2
        return {
            "patch_size": patch,
            "merge_size": merge,
            "temporal_patch_size": 2,
            "min_pixels": m.get("vision.image_min_pixels", 8 * token),
            "max_pixels": m.get("vision.image_max_pixels", 4096 * token),
            "resample": 3,
            "image_mean": list(m["vision.image_mean"]),
            "image_std": list(m["vision.image_std"]),
        }

    def convert_mmproj_weights(self, tensors: dict) -> dict:
        """An mmproj file's tensors -> the model's: q, k and v fused back into qkv, the two frames' 2D patch kernels
        stacked into the 3D one and flattened."""
        weights = fuse(TOWER_GGUF_NAMES.to_ours(tensors), "qkv", ["q", "k", "v"])
        kernel = "vision.embed.proj.weight"
        frames = [weights.pop(kernel), weights.pop(kernel + ".1")]
        return flattened_kernel({**weights, kernel: mx.stack(frames, axis=2)}, kernel)


@register("qwen2_vl")
@dataclass
class Qwen2VLConfig(Qwen25VLConfig):
    """Qwen2-VL: Qwen2.5-VL's text side and processor; a tower of LayerNorm and QuickGELU-MLP blocks without windows."""

    example_config = {**Qwen25VLConfig.example_config, "model_type": "qwen2_vl"}
    names = qwen_vl_names(QWEN2_VL_MLP_NAMES + TOWER_NAMES)
    mmproj_projectors = ("qwen2vl_merger",)
    mmproj_model_type = "qwen2_vl"

    @staticmethod
    def tower_settings(vision: dict) -> WindowedTowerSettings:
        return WindowedTowerSettings.qwen2_vl(vision)

    @staticmethod
    def mmproj_tower(m: Metadata, shapes: dict) -> dict:
        """Qwen2-VL's `vision_config` from an mmproj file's clip.vision keys, its FFN's width from `ffn_up`'s rows
        (llama.cpp's converter writes the tower's output width as feed_forward_length)."""
        dims, up = m["vision.embedding_length"], shapes.get("v.blk.0.ffn_up.weight")
        if up is None:
            raise CheckpointError("the mmproj file lacks v.blk.0.ffn_up.weight; it is incomplete, re-convert it")
        return {
            "depth": m["vision.block_count"],
            "embed_dim": dims,
            "mlp_ratio": up[0] / dims,
            "num_heads": m["vision.attention.head_count"],
            "hidden_size": m["vision.projection_dim"],
            "patch_size": m["vision.patch_size"],
            "spatial_merge_size": m.get("vision.spatial_merge_size", 2),
            "temporal_patch_size": 2,
        }
