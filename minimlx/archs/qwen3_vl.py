"""Qwen3-VL (and its MoE): Qwen3's text model read with an interleaved multimodal RoPE, and Qwen3-VL's vision tower.

The tower embeds the patches (a biased 3D patch convolution as a matmul) plus learned position embeddings resampled
bilinearly to the picture's patch grid, runs LayerNorm and MLP blocks over the whole picture with 2D rotary
positions (Qwen2.5-VL's), and merges each 2 x 2 block into one soft token. DeepStack: the outputs of the blocks in
`deepstack_visual_indexes` go through mergers of their own (normed once joined), and the language model adds them
at the image tokens after its first layers, one level per layer.

The image processor, the image tokens and the positions (time, row, column) are Qwen2.5-VL's; the multimodal RoPE
interleaves its axes over the frequencies (`MultimodalRoPE(interleaved=True)`).
"""

from dataclasses import dataclass

from .image_text import text_model_names, with_vision_names
from .qwen2_vl import QwenImages, WindowedTowerSettings
from .qwen3 import Qwen3Config, Qwen3MoeConfig
from .registry import register

TOWER_NAMES = [
    ("patch_embed.proj.", "embed.proj."),
    ("pos_embed.", "positions."),
    ("blocks.{i}.mlp.linear_fc1.", "layers.{i}.mlp.up_proj."),
    ("blocks.{i}.mlp.linear_fc2.", "layers.{i}.mlp.down_proj."),
    ("blocks.{i}.", "layers.{i}."),
    ("merger.linear_fc1.", "merger.up."),
    ("merger.linear_fc2.", "merger.down."),
    ("merger.", "merger."),
    ("deepstack_merger_list.{i}.linear_fc1.", "deepstack.{i}.up."),
    ("deepstack_merger_list.{i}.linear_fc2.", "deepstack.{i}.down."),
    ("deepstack_merger_list.{i}.", "deepstack.{i}."),
]
"""Qwen3-VL's tower (Qwen3.5's has no DeepStack mergers), under `model.visual.` (the published layout) or `visual.`."""


def qwen3_vl_names(text):
    """`text` (a text model's map) under the image-text layouts, with Qwen3-VL's tower."""
    towers = [(theirs, "vision." + ours) for theirs, ours in TOWER_NAMES]
    return with_vision_names(text_model_names(text), ("model.visual.", "visual."), towers, [])


class Qwen3VisionTower:
    """Qwen3-VL's tower settings and interleaved multimodal RoPE: put before `QwenImages` in an image-text plugin's
    bases."""

    mrope_interleaved = True

    @staticmethod
    def tower_settings(vision: dict) -> WindowedTowerSettings:
        return WindowedTowerSettings.qwen3_vl(vision)


@register("qwen3_vl")
@dataclass
class Qwen3VLConfig(Qwen3VisionTower, QwenImages, Qwen3Config):
    example_config = {
        "model_type": "qwen3_vl",
        "text_config": {
            **Qwen3Config.example_config,
            "rope_parameters": {"rope_theta": 1e4, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        },
    }
    names = qwen3_vl_names(Qwen3Config.names)


@register("qwen3_vl_moe")
@dataclass
class Qwen3VLMoeConfig(Qwen3VisionTower, QwenImages, Qwen3MoeConfig):
    """Qwen3-VL's MoE: Qwen3-MoE's text model, whose chosen experts' weights are always renormalised; its experts
    fused, as the published checkpoints store them ((experts, dims, 2 * hidden) and (experts, hidden, dims)) or as
    transformers holds them in memory and saves them ((experts, 2 * hidden, dims), (experts, dims, hidden))."""

    example_config = {**Qwen3VLConfig.example_config, "model_type": "qwen3_vl_moe"}
    example_config["text_config"] = {**Qwen3MoeConfig.example_config, **Qwen3VLConfig.example_config["text_config"]}
    names = qwen3_vl_names(Qwen3MoeConfig.names)

    @classmethod
    def from_config(cls, config: dict):
        text = config.get("text_config")
        if isinstance(text, dict):
            config = {**config, "text_config": {**text, "norm_topk_prob": True}}
        return super().from_config({**config, "norm_topk_prob": True})

    def convert_weights(self, weights: dict) -> dict:
        return super().convert_weights({k: self.in_memory_layout(k, v) for k, v in weights.items()})

    def in_memory_layout(self, name: str, w):
        """A fused expert tensor in transformers' in-memory layout (the published one transposed), as its loader
        tells them apart: by which axis has the model's width."""
        if name.endswith(".experts.gate_up_proj") and w.shape[1] == self.dims != w.shape[2]:
            return w.swapaxes(1, 2)
        if name.endswith(".experts.down_proj") and w.shape[2] == self.dims != w.shape[1]:
            return w.swapaxes(1, 2)
        return w
