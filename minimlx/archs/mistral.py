"""Mistral and Mixtral: LLaMA's block, with a sliding attention window, and (Mixtral) a mixture of experts.

Sliding-window attention lets each token see only itself and the `sliding_window - 1` tokens before it;
each layer's cache keeps just those, so its memory stops growing at the window.

Mixtral swaps every FFN for eight SwiGLU experts (`w1` gate, `w3` up, `w2` down) of which a softmax
router picks two per token, their weights renormalised to sum to 1.

Mistral's 2025-26 models: Ministral 3 (Mistral's block, yarn RoPE, and a query temperature that rises with the
position past the pre-yarn context), its image-text checkpoints (`mistral3`), and Mistral 4 (DeepSeek-V2's latent
attention and grouped experts, with that temperature).

Mistral 3's image-text checkpoints add the Pixtral encoder (patches of pictures of any size, RMSNorm blocks with 2D
rotary positions and gated GELU FFNs, several pictures in one pass with block-diagonal attention) and a projector
that merges each `spatial_merge_size` square of patches into one soft token. A picture's soft tokens stand in the
prompt row by row, `[IMG]` per token, `[IMG_BREAK]` after each row, `[IMG_END]` after the last, and are read as the
text is (causally).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.ffn import ACTIVATIONS
from ..core.grid_vision import GridEncoder, GridImageEncoder, MergedProjector
from ..errors import CheckpointError, UnsupportedArchitectureError
from .config import choice, number, require, sliding_window
from .decoder import DecoderConfig
from .deepseek_moe import GGUF_NAMES as LATENT_GGUF_NAMES
from .deepseek_moe import NAMES as LATENT_NAMES
from .deepseek_moe import DeepseekV2Config
from .experts import MoEConfig
from .fused import split_fused
from .gguf import Metadata, llama_config
from .image_text import ImageText, text_model_names, with_vision_names, write_out_images
from .llama3 import Llama3Config
from .names import LLAMA_NAMES, NameMap
from .registry import register

EXPERT_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def position_temperature(scaling: dict | None) -> tuple | None:
    """Mistral's query temperature (`QueryTemperature`'s beta, span, shift) from `llama_4_scaling_beta` and the
    pre-yarn context in the RoPE scaling; None without one, or with a beta of 0 (queries unscaled)."""
    scaling = scaling or {}
    if scaling.get("llama_4_scaling_beta") == 0:
        return None
    beta = number(scaling, "llama_4_scaling_beta", None, float, label="rope_parameters.llama_4_scaling_beta")
    if beta is None:
        return None
    label = "rope_parameters.original_max_position_embeddings"
    return beta, number(scaling, "original_max_position_embeddings", label=label), 0


@register("mistral")
@dataclass
class MistralConfig(DecoderConfig):
    example_config = {**Llama3Config.example_config, "model_type": "mistral", "sliding_window": 16}

    @classmethod
    def from_config(cls, config: dict):
        return replace(super().from_config(config), window=sliding_window(config))


@register("mixtral")
@dataclass
class MixtralConfig(MistralConfig):
    example_config = {**MistralConfig.example_config, "model_type": "mixtral", "num_local_experts": 4}
    names = LLAMA_NAMES.extended(
        [
            ("model.layers.{i}.block_sparse_moe.gate.", "layers.{i}.ffn.router.proj."),
            ("model.layers.{i}.block_sparse_moe.switch_mlp.", "layers.{i}.ffn.experts."),
            ("model.layers.{i}.block_sparse_moe.experts.", "layers.{i}.ffn.experts."),
        ]
    )
    gguf_rows_permuted = True  # llama.cpp writes Mixtral as `llama`

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        experts, chosen = number(config, "num_local_experts", 8), number(config, "num_experts_per_tok", 2)
        require(chosen <= experts, f"num_experts_per_tok ({chosen}) must be at most num_local_experts ({experts})")
        return replace(arch, moe=MoEConfig(experts, chosen, arch.ffn_dims, normalize=True))

    def convert_weights(self, weights: dict) -> dict:
        """Hugging Face's per-expert `w1`, `w3`, `w2` are the experts' gate, up and down projections."""
        renamed = {}
        for name, w in weights.items():
            for theirs, ours in EXPERT_NAMES.items():
                name = name.replace(theirs, ours) if ".experts." in name else name
            renamed[name] = w
        return super().convert_weights(renamed)


@register("ministral3")
@dataclass
class Ministral3Config(MistralConfig):
    """Ministral 3 and Mistral's 2025-26 dense models: Mistral's block, yarn RoPE, and queries scaled up with their
    position past the pre-yarn context (`llama_4_scaling_beta` in `rope_parameters`, a `QueryTemperature`)."""

    example_config = {
        **MistralConfig.example_config,
        "model_type": "ministral3",
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 4,
            "llama_4_scaling_beta": 0.1,
        },
    }
    gguf_architectures = ("mistral3",)
    gguf_rows_permuted = True  # llama.cpp's converter writes them as LLaMA's

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        return replace(arch, query_temperature=position_temperature(arch.rope_scaling))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's `mistral3` (the text of Ministral 3 and of Mistral 3's image-text checkpoints): LLaMA's keys,
        the query temperature's beta as `attention.temperature_scale`, and yarn's `mscale_all_dim` as
        `rope.scaling.yarn_log_multiplier` (llama.cpp takes mscale to be 1)."""
        m = Metadata(metadata)
        config = llama_config(metadata, tensors, "ministral3")
        scaling = config["rope_scaling"]
        if scaling is not None and scaling["rope_type"] == "yarn":
            if (log_mul := m.get("rope.scaling.yarn_log_multiplier")) is not None:
                scaling.update(mscale=1.0, mscale_all_dim=log_mul)
            if (beta := m.get("attention.temperature_scale")) is not None:
                scaling["llama_4_scaling_beta"] = beta
        return {**config, "sliding_window": m.get("attention.sliding_window")}


PIXTRAL_NAMES = [
    ("patch_conv.", "encoder.proj."),
    ("ln_pre.", "encoder.norm."),
    ("transformer.layers.{i}.attention_norm.", "encoder.layers.{i}.attn_norm."),
    ("transformer.layers.{i}.attention.", "encoder.layers.{i}.attn."),
    ("transformer.layers.{i}.ffn_norm.", "encoder.layers.{i}.ffn_norm."),
    ("transformer.layers.{i}.feed_forward.", "encoder.layers.{i}.ffn."),
]

MISTRAL3_PROJECTOR_NAMES = [
    ("multi_modal_projector.patch_merger.merging_layer.", "projector.merging."),
    ("multi_modal_projector.", "projector."),
]


def pixtral_names(text: NameMap) -> NameMap:
    """`text` (a text model's map under the image-text layouts) with the Pixtral tower and Mistral 3's projector:
    the published and transformers-saved names (`vision_tower.`, `multi_modal_projector.`), transformers 5's own
    (under `model.`) and mlx-vlm's (`vision_tower.vision_model.`)."""
    prefixes = ("vision_tower.", "model.vision_tower.", "vision_tower.vision_model.")
    tower = [(theirs, f"vision.{ours}") for theirs, ours in PIXTRAL_NAMES]
    projector = [(theirs, f"vision.{ours}") for theirs, ours in MISTRAL3_PROJECTOR_NAMES]
    return with_vision_names(text, prefixes, tower, projector)


@dataclass(frozen=True)
class PixtralSettings:
    """The Pixtral encoder's sizes (`vision_config`) and Mistral 3's projector (the outer config's keys)."""

    dims: int
    ffn_dims: int
    layers: int
    heads: int
    patch: int
    channels: int
    rope_base: float
    activation: str
    merge: int  # spatial_merge_size: soft tokens are merge x merge squares of patches
    feature_layer: int
    projector_activation: str
    projector_bias: bool

    @classmethod
    def from_config(cls, config: dict) -> "PixtralSettings":
        vision = config["vision_config"]
        rope = vision.get("rope_parameters") or {}
        layer = config.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise UnsupportedArchitectureError(
                f"vision_feature_layer {layer!r}: one layer is read (an int), not several; fix the config"
            )
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise UnsupportedArchitectureError(f"the Pixtral encoder's rope {rope.get('rope_type')!r} is not axial")
        layers = number(vision, "num_hidden_layers")
        require(-layers - 1 <= layer <= layers, f"vision_feature_layer {layer} is outside the {layers} layers")
        return cls(
            dims=number(vision, "hidden_size"),
            ffn_dims=number(vision, "intermediate_size"),
            layers=layers,
            heads=number(vision, "num_attention_heads"),
            patch=number(vision, "patch_size"),
            channels=number(vision, "num_channels", 3),
            rope_base=number(rope, "rope_theta", vision.get("rope_theta", 10000.0), float),
            activation=choice(vision, "hidden_act", "gelu", ACTIVATIONS),
            merge=number(config, "spatial_merge_size", 2),
            feature_layer=layer,
            projector_activation=choice(config, "projector_hidden_act", "gelu", ACTIVATIONS),
            projector_bias=bool(config.get("multimodal_projector_bias", False)),
        )


@register("mistral3")
@dataclass
class Mistral3Config(ImageText, Ministral3Config):
    """Mistral 3's image-text checkpoints (Ministral 3, Mistral Small 3.1+): the text model (`text_config`, a
    `ministral3` or a `mistral` model's; a `mistral4` one, Mistral Small 4's, is read as `Mistral4ImageText`) and,
    where the config has a `vision_config`, the Pixtral encoder and Mistral 3's projector, whose soft tokens stand at
    the `[IMG]` places."""

    example_config = {"model_type": "mistral3", "text_config": Ministral3Config.example_config}
    names = pixtral_names(text_model_names(LLAMA_NAMES))
    image_text_type = "mistral3"
    inherited = {"tie_word_embeddings": True}
    reads_images = True

    vision: PixtralSettings | None = None
    image_token: int = 10
    image_break_token: int = 12  # tekken's ids, where neither the config nor the tokenizer names them
    image_end_token: int = 13
    layout_named: bool = False  # whether the config named [IMG_BREAK] and [IMG_END] (else the tokenizer spells them)

    @classmethod
    def from_config(cls, config: dict):
        text = config.get("text_config")
        if isinstance(text, dict) and text.get("model_type") == "mistral4":  # Mistral Small 4: its text model
            return Mistral4ImageText.from_config(config)
        arch = super().from_config(config)
        if not isinstance(config.get("vision_config"), dict):
            return arch
        image = number(config, "image_token_index", 10, low=0)
        named = {**config["vision_config"], **config}  # (Mistral's params.json names them under its vision encoder)
        break_token, end_token = (
            number(named, key, None, low=0) for key in ("image_break_token_id", "image_end_token_id")
        )
        if (break_token is None) != (end_token is None):
            raise CheckpointError(
                "the config names one of image_break_token_id and image_end_token_id but not the other: name both"
            )
        arch = replace(arch, vision=PixtralSettings.from_config(config), image_token=image, image_start_token=image)
        if break_token is None:
            return arch
        return replace(arch, image_break_token=break_token, image_end_token=end_token, layout_named=True)

    def with_tokenizer(self, tokenizer) -> "Mistral3Config":
        """`[IMG_BREAK]` and `[IMG_END]` as the tokenizer's vocabulary has them, where the config does not name them."""
        if self.layout_named:
            return self
        ids = [tokenizer.token_id(token) for token in ("[IMG_BREAK]", "[IMG_END]")]
        if None in ids:  # a vocabulary without them: tekken's
            return self
        return replace(self, image_break_token=ids[0], image_end_token=ids[1])

    def image_encoder(self) -> GridImageEncoder | None:
        v = self.vision
        if v is None:
            return None
        encoder = GridEncoder(
            v.dims, v.ffn_dims, v.layers, v.heads, v.patch, v.rope_base, v.channels, 1e-5, v.activation, v.feature_layer
        )
        projector = MergedProjector(v.dims, self.dims, v.merge, self.norm_eps, v.projector_activation, v.projector_bias)
        return GridImageEncoder(encoder, projector)

    def image_processor(self, settings: dict):
        from ..vision import LongestEdgeImages

        return LongestEdgeImages.from_config(settings, multiple=self.vision.patch * self.vision.merge)

    def image_places(self, image) -> int:
        rows, cols = image.grid
        return rows * cols

    def image_runs(self, image) -> tuple[int, ...]:
        rows, cols = image.grid
        return (cols,) * rows

    def image_layout(self, image) -> list[int]:
        """The places of an image of (rows, columns) soft tokens, as Pixtral's processor writes them: `[IMG]` per
        token, `[IMG_BREAK]` after each row but the last, `[IMG_END]` after it."""
        rows, cols = image.grid
        row = [self.image_token] * cols + [self.image_break_token]
        return (row * rows)[:-1] + [self.image_end_token]

    def expand_images(self, ids: list[int], images: Sequence = ()) -> list[int]:
        """A prompt's ids with each `[IMG]` the chat template writes (one per image) replaced by its image's layout
        (`image_layout`), as Pixtral's processor does; an image already written out is kept."""
        return write_out_images(ids, images, self.image_token, self.image_layout)

    def convert_weights(self, weights: dict) -> dict:
        """The text model's and the towers' tensors; the patch convolution's kernel, (dims, channels, p, p) as torch
        writes it or (dims, p, p, channels) as mlx-vlm does, flattened to the patch projection's (channel, row,
        column) order."""
        weights = super().convert_weights(weights)
        name = "vision.encoder.proj.weight"
        if name in weights and weights[name].ndim == 4:
            kernel, v = weights[name], self.vision
            if kernel.shape[1:] == (v.patch, v.patch, v.channels) and v.patch != v.channels:
                kernel = kernel.transpose(0, 3, 1, 2)
            weights[name] = kernel.reshape(kernel.shape[0], -1)
        return weights

    def export_weights(self, weights: dict) -> dict:
        name, v = "vision.encoder.proj.weight", self.vision
        if name in weights:
            weights = {**weights, name: weights[name].reshape(v.dims, v.channels, v.patch, v.patch)}
        return super().export_weights(weights)


@register("mistral4")
@dataclass
class Mistral4Config(DeepseekV2Config):
    """Mistral 4: DeepSeek-V2's latent attention (yarn RoPE on adjacent pairs unless `rope_interleave` is false) with
    Mistral's query temperature, and from `first_k_dense_replace` on a mixture of experts whose softmax router keeps
    the `topk_group` groups with the highest sums of their two best scores, then the top `num_experts_per_tok`
    experts, renormalised and scaled; shared experts beside them."""

    example_config = {
        **DeepseekV2Config.example_config,
        "model_type": "mistral4",
        "first_k_dense_replace": 0,
        "q_lora_rank": 16,
    }
    defaults = {"rms_norm_eps": 1e-6, "norm_topk_prob": True, "n_shared_experts": 1}
    gguf_architectures = ("mistral4",)
    gguf_names = LATENT_GGUF_NAMES.extended([("blk.{i}.ffn_gate_up_exps.", "layers.{i}.ffn.experts.gate_up_proj.")])

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}
        arch = super().from_config({**c, "topk_method": "group_limited_greedy", "scoring_func": "softmax"})
        moe = arch.moe and replace(arch.moe, group_top=2)
        return replace(arch, moe=moe, query_temperature=position_temperature(arch.rope_scaling))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's `mistral4`: DeepSeek-V2's keys, and the query temperature as llama.cpp applies it: beta
        `attention.temperature_scale` over spans of `attention.temperature_length` positions, and none where the file
        has no scale (llama.cpp's converter writes none). The span must be yarn's pre-yarn context, the one the
        temperature counts in Hugging Face's config."""
        m = Metadata(metadata)
        config = {**super().gguf_config(metadata, tensors), "model_type": "mistral4"}
        if not (beta := m.get("attention.temperature_scale")):
            return config
        scaling, span = config["rope_scaling"] or {}, m.get("attention.temperature_length")
        if span is None or span != scaling.get("original_max_position_embeddings"):
            raise UnsupportedArchitectureError(
                f"GGUF {m.arch}.attention.temperature_length ({span}) is not the yarn pre-yarn context "
                f"({scaling.get('original_max_position_embeddings')}); minimlx reads Mistral's query temperature over "
                "that context only: re-convert the file from its Hugging Face folder"
            )
        return {**config, "rope_scaling": {**scaling, "llama_4_scaling_beta": beta}}

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """DeepSeek-V2's, with the experts' fused `ffn_gate_up_exps` (each expert's gate rows, then its up rows)
        split."""
        weights = super().convert_gguf_weights(tensors, metadata)
        rows = self.moe.ffn_dims if self.moe else 0
        return split_fused(weights, "gate_up_proj", [("gate_proj", rows), ("up_proj", rows)], axis=1)


@dataclass
class Mistral4ImageText(ImageText, Mistral4Config):
    """The text model of Mistral 4's image-text checkpoints: a `mistral3` config whose `text_config` is a
    `mistral4` model's."""

    names = text_model_names(LATENT_NAMES)
    image_text_type = "mistral3"
    inherited = {"tie_word_embeddings": True}
