"""Gemma 2 and Gemma 3 (text, and the text part of Gemma 3's image-text checkpoints).

Blocks: (1 + w) RMSNorm -> grouped-query attention -> (1 + w) RMSNorm, added; (1 + w) RMSNorm -> GELU-tanh
gated FFN -> (1 + w) RMSNorm, added (four norms a block). Most layers are local: they attend through a
sliding window (Gemma 2 alternates local and global layers, Gemma 3 has five local to each global one)
and Gemma 3 gives them their own RoPE base. Queries are scaled by 1/sqrt(query_pre_attn_scalar); tokens are
embedded times sqrt(hidden_size); the head is the embedding's transpose. Gemma 2 soft-caps the attention
scores and the logits; Gemma 3 instead norms each query and key head.

llama.cpp's `gemma2` and `gemma3` files store every norm weight with its 1 already added, keep no
query_pre_attn_scalar (llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden/heads) in the 27B models) and
no layer pattern unless `sliding_window_pattern` says so (Gemma 2 alternates, Gemma 3 has five local to one global).
A Gemma 3 file holds the text model only; llama.cpp writes the vision tower to a separate mmproj file, and tensors
of one bundled in (`v.*`, `mm.*`) are left out.

Gemma 3's image-text checkpoints add a SigLIP encoder (patch embedding, LayerNorm blocks with GELU-tanh MLPs, a final
LayerNorm) and a projector that average-pools its patch grid to `mm_tokens_per_image` soft tokens, (1 + w)-RMS-norms
and projects them; an image's soft tokens see each other both ways in every layer (within the window in local ones).
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core import OffsetRMSNorm
from ..core.ffn import ACTIVATIONS
from ..core.vision import FixedSizeImageEncoder, PooledProjector, VisionEncoder
from ..errors import UnsupportedArchitectureError
from .config import choice, flag, global_layers, number, rope_scaling
from .decoder import DecoderConfig
from .gguf import Metadata, llama_config, windows
from .image_text import (
    SIGLIP_NAMES,
    ImageText,
    VisionSettings,
    flattened_kernel,
    shaped_kernel,
    text_model_names,
    vocabulary_ids,
    with_vision_names,
)
from .llama3 import Llama3Config
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES, POST_NORM_GGUF_NAMES, NameMap
from .registry import register

GEMMA_NAMES = LLAMA_NAMES.extended(
    [
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.post_attn_norm."),
        ("model.layers.{i}.pre_feedforward_layernorm.", "layers.{i}.ffn_norm."),
        ("model.layers.{i}.post_feedforward_layernorm.", "layers.{i}.post_ffn_norm."),
    ]
)

GEMMA_GGUF_NAMES = LLAMA_GGUF_NAMES.extended(POST_NORM_GGUF_NAMES, drop=[r"^(v|mm)\."])


def gemma_gguf_config(metadata: dict, tensors: dict, model_type: str, pattern: int, window, local_base, big_layers):
    """A Gemma file's config: llama.cpp's keys, its query scale (the 27B models are `big_layers` deep), soft-caps,
    windows (`window` where the file names none) and the local layers' RoPE base (`local_base` where the file names
    none; None: the global one)."""
    m = Metadata(metadata)
    config = llama_config(metadata, tensors, model_type)
    big = config["num_hidden_layers"] == big_layers
    return {
        **config,
        **windows(m, pattern, window),
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"],
        "attn_logit_softcapping": m.get("attn_logit_softcapping"),
        "final_logit_softcapping": m.get("final_logit_softcapping"),
        "rope_local_base_freq": m.get("rope.freq_base_swa", local_base or config["rope_theta"]),
    }


@register("gemma2")
@dataclass
class Gemma2Config(DecoderConfig):
    example_config = {**Llama3Config.example_config, "model_type": "gemma2", "head_dim": 8, "sliding_window": 4}
    names = GEMMA_NAMES
    gguf_architectures = ("gemma2",)
    gguf_names = GEMMA_GGUF_NAMES
    # transformers' defaults for keys that published configs may leave out (a null cap: no capping)
    defaults = {
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }

    norm_class: type = OffsetRMSNorm
    norms: str = "both"

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}  # the family's own keys have defaults too
        if flag(c, "use_bidirectional_attention"):
            raise UnsupportedArchitectureError("bidirectional Gemma (use_bidirectional_attention) is not supported")
        arch = super().from_config(c)
        window = number(c, "sliding_window", None)
        return replace(
            arch,
            activation=choice(c, "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS),
            query_scale=number(c, "query_pre_attn_scalar", kind=float) ** -0.5,
            window=window,
            global_layers=global_layers(c, arch.layers, 2) if window else (),  # without a pattern: alternating
            local_rope_base=number(c, "rope_local_base_freq", None, float),
            local_rope_scaling=rope_scaling(c, "rope_local_scaling"),
            attention_cap=number(c, "attn_logit_softcapping", None, float),
            logit_cap=number(c, "final_logit_softcapping", None, float),
            embed_scale=arch.dims**0.5,
        )

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return gemma_gguf_config(metadata, tensors, "gemma2", 2, window=4096, local_base=None, big_layers=46)

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """The norms' weights less the 1 llama.cpp's converter added."""
        weights = super().convert_gguf_weights(tensors, metadata)
        return {name: w - 1 if name.endswith("norm.weight") else w for name, w in weights.items()}


@register("gemma3_text")
@dataclass
class Gemma3TextConfig(Gemma2Config):
    """Local layers read `rope_local_base_freq` (`normalize_config` puts transformers 5's per-layer-type RoPE
    there); no soft-caps; q/k norms."""

    example_config = {
        **Gemma2Config.example_config,
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "sliding_window_pattern": 3,
    }
    gguf_architectures = ("gemma3",)
    defaults = {
        **Gemma2Config.defaults,
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,  # five local layers to each global one
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }

    qk_norm: bool = True

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        return gemma_gguf_config(metadata, tensors, "gemma3_text", 6, window=None, local_base=1e4, big_layers=62)


SIGLIP_GGUF_NAMES = NameMap(
    [
        ("v.patch_embd.", "vision.encoder.embed.proj."),
        ("v.position_embd.", "vision.encoder.embed.position_embedding."),
        ("v.blk.{i}.ln1.", "vision.encoder.layers.{i}.attn_norm."),
        ("v.blk.{i}.ln2.", "vision.encoder.layers.{i}.ffn_norm."),
        ("v.blk.{i}.attn_q.", "vision.encoder.layers.{i}.attn.q_proj."),
        ("v.blk.{i}.attn_k.", "vision.encoder.layers.{i}.attn.k_proj."),
        ("v.blk.{i}.attn_v.", "vision.encoder.layers.{i}.attn.v_proj."),
        ("v.blk.{i}.attn_out.", "vision.encoder.layers.{i}.attn.o_proj."),
        ("v.blk.{i}.ffn_up.", "vision.encoder.layers.{i}.ffn.up_proj."),
        ("v.blk.{i}.ffn_down.", "vision.encoder.layers.{i}.ffn.down_proj."),
        ("v.post_ln.", "vision.encoder.norm."),
        ("mm.input_projection.weight", "vision.projector.projection"),
        ("mm.soft_emb_norm.", "vision.projector.norm."),
    ]
)  # llama.cpp's mmproj names of Gemma 3's SigLIP tower and projector

GEMMA3_PROJECTOR_NAMES = [
    ("multi_modal_projector.mm_input_projection_weight", "vision.projector.projection"),
    ("multi_modal_projector.mm_soft_emb_norm.", "vision.projector.norm."),
]


def image_text_names(text: NameMap) -> NameMap:
    """`text` (a text model's map under the image-text layouts) with Gemma 3's vision tower and projector read too:
    the published checkpoints' names first (`vision_tower.vision_model.`), then those transformers 5 writes (without
    `vision_model.`, or under `model.`). The SigLIP pooling head some towers carry is unused and left out."""
    prefixes = (
        "vision_tower.vision_model.",
        "model.vision_tower.vision_model.",
        "vision_tower.",
        "model.vision_tower.",
    )
    tower = [(theirs, f"vision.encoder.{ours}") for theirs, ours in SIGLIP_NAMES]
    head = r"^(model\.)?vision_tower\.(vision_model\.)?head\."
    return with_vision_names(text, prefixes, tower, GEMMA3_PROJECTOR_NAMES, drop=[head])


@register("gemma3")
@dataclass
class Gemma3Config(ImageText, Gemma3TextConfig):
    """Gemma 3's image-text checkpoints: the text model (tied unless the checkpoint says not) and, where the config
    has a `vision_config`, the image encoder whose soft tokens stand in the prompt at `image_token`'s runs."""

    example_config = {"model_type": "gemma3", "text_config": Gemma3TextConfig.example_config}
    names = image_text_names(text_model_names(GEMMA_NAMES))
    image_text_type = "gemma3"
    inherited = {"tie_word_embeddings": True}
    reads_images = True

    vision: VisionSettings | None = None
    image_token: int = 262144
    image_start_token: int = 255999  # the token the chat template writes where an image goes
    image_end_token: int = 256000
    mmproj_projectors = ("gemma3",)  # llama.cpp's clip.projector_type of the mmproj files it reads
    mmproj_text = ("gemma3",)  # the GGUF text files' architectures those towers go with
    image_tokens = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")  # their texts in the vocabulary

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return arch
        return replace(
            arch,
            vision=VisionSettings.from_config(vision, number(config, "mm_tokens_per_image", 256)),
            image_token=number(config, "image_token_index", 262144),
            image_start_token=number(config, "boi_token_index", 255999),
            image_end_token=number(config, "eoi_token_index", 256000),
        )

    @classmethod
    def mmproj_config(cls, text: dict, text_metadata: dict, clip: dict, shapes: dict) -> dict:
        """The image-text config of a text file's config `text` (its `gguf_config`) and a llama.cpp mmproj file's
        metadata `clip` (`shapes`: its tensors' shapes, by name): the tower's sizes from its clip.vision keys (its
        projector pools 4 x 4 patches unless clip.vision.projector.scale_factor says otherwise), the image tokens' ids
        looked up in the text file's vocabulary by their texts."""
        m = Metadata(clip)
        start, end, soft = vocabulary_ids(text_metadata, cls.image_tokens, "Gemma 3")
        side = m["vision.image_size"] // m["vision.patch_size"] // m.get("vision.projector.scale_factor", 4)
        vision = {
            "hidden_size": m["vision.embedding_length"],
            "intermediate_size": m["vision.feed_forward_length"],
            "num_hidden_layers": m["vision.block_count"],
            "num_attention_heads": m["vision.attention.head_count"],
            "image_size": m["vision.image_size"],
            "patch_size": m["vision.patch_size"],
            "layer_norm_eps": m.get("vision.attention.layer_norm_epsilon", 1e-6),
        }
        return {
            "model_type": "gemma3",
            "text_config": text,
            "vision_config": vision,
            "mm_tokens_per_image": side * side,
            "tie_word_embeddings": text.get("tie_word_embeddings", True),
            "boi_token_index": start,
            "eoi_token_index": end,
            "image_token_index": soft,
        }

    @classmethod
    def mmproj_processor(cls, clip: dict) -> dict:
        """The image processor's config (preprocessor_config.json's form) an mmproj file's metadata gives: Gemma 3's
        (bilinear resize to the square image size, rescale, normalise by the file's mean and std)."""
        m, size = Metadata(clip), Metadata(clip)["vision.image_size"]
        return {
            "size": {"height": size, "width": size},
            "resample": 2,
            "image_mean": list(m.get("vision.image_mean", (0.5,) * 3)),
            "image_std": list(m.get("vision.image_std", (0.5,) * 3)),
        }

    def convert_mmproj_weights(self, tensors: dict) -> dict:
        """An mmproj file's tensors -> the model's: the projector's norm less the 1 llama.cpp's converter added, the
        patch embedding's kernel flattened."""
        weights = SIGLIP_GGUF_NAMES.to_ours(tensors)
        weights["vision.projector.norm.weight"] = weights["vision.projector.norm.weight"] - 1
        return flattened_kernel(weights, "vision.encoder.embed.proj.weight")

    images_both_ways = True

    def image_encoder(self) -> FixedSizeImageEncoder | None:
        v = self.vision
        if v is None:
            return None
        encoder = VisionEncoder(v.dims, v.ffn_dims, v.layers, v.heads, v.image_size, v.patch, v.channels, v.eps)
        return FixedSizeImageEncoder(
            encoder, PooledProjector(v.dims, self.dims, v.image_size // v.patch, v.tokens, v.eps)
        )

    def image_processor(self, settings: dict):
        from ..vision import FixedSizeImages

        return FixedSizeImages.from_config(settings)

    def image_places(self, image) -> int:
        return self.vision.tokens

    def image_grids(self, image) -> tuple[tuple[int, int], tuple[int, int]]:
        side, tokens = self.vision.image_size // self.vision.patch, int(round(self.vision.tokens**0.5))
        return (side, side), (tokens, tokens)

    def write_images_text(self, text: str) -> str:
        """Each image start token of `text` not yet followed by soft tokens written out as Gemma 3's processor writes
        it: between blank lines, which its tokenizer merges with the text around them, its soft-token places and its
        end token."""
        if self.vision is None:
            return text
        start, end, soft = self.image_tokens
        written = f"\n\n{start}{soft * self.vision.tokens}{end}\n\n"
        return re.sub(f"{re.escape(start)}(?!{re.escape(soft)})", lambda _: written, text)

    def expand_images(self, ids: list[int], images: Sequence = ()) -> list[int]:
        """A prompt's ids with each image start token followed by the image's soft-token places and its end token,
        unless they already are (a prompt of ids; one of text is written out by `write_images_text`)."""
        out = []
        for i, token in enumerate(ids):
            out.append(token)
            if token == self.image_start_token and (i + 1 == len(ids) or ids[i + 1] != self.image_token):
                out += [self.image_token] * self.vision.tokens + [self.image_end_token]
        return out

    def convert_weights(self, weights: dict) -> dict:
        """The text model's and the towers' tensors; the patch embedding's (dims, channels, p, p) kernel flattened."""
        return flattened_kernel(super().convert_weights(weights), "vision.encoder.embed.proj.weight")

    def export_weights(self, weights: dict) -> dict:
        v = self.vision
        shape = (v.dims, v.channels, v.patch, v.patch) if v is not None else ()
        return super().export_weights(shaped_kernel(weights, "vision.encoder.embed.proj.weight", shape))
