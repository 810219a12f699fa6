"""The settings the decoder families differ by, and the one recipe that builds each of them from core parts.

LLaMA's block is the plain case: RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU FFN, the head
tied to the embedding or separate. The other families change a few things: biases, a norm on queries and keys, RoPE
on part of each head, a sliding window, where the norms sit, a mixture of experts, latent attention. `DecoderConfig`
holds each of those as a field and builds every family from them (`rope`, `attention`, `ffn`, `block`, `build`), so
a family's plugin sets fields, as defaults or from its own config keys in `from_config`, and builds nothing itself.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import mlx.nn as nn

from ..core import (
    Attention,
    Block,
    FourNormBlock,
    GatedDeltaNet,
    GatedFFN,
    GatedShortConv,
    Indexer,
    LatentAttention,
    LayerInputBlock,
    PerLayerInputs,
    PostNormBlock,
    QueryTemperature,
    RMSNorm,
    RoPE,
    SelectiveStateSpace,
    SharedKVAttention,
    SwiGLU,
    Transformer,
)
from ..core.ffn import ACTIVATIONS
from ..core.vision import PlacedImages
from ..errors import UnsupportedArchitectureError
from .config import MAX_LAYERS, flag, number, require, rope_scaling
from .experts import GATE_FIRST, MoEConfig, stack_experts
from .fused import fuse, split_fused
from .gguf import llama_config, unpermute_rows
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES


class RecurrentMixer:
    """A recurrent token-mixer's settings: the layers that have one in attention's place, and how to build it."""

    layers: tuple[int, ...]

    def build(self, dims: int, eps: float) -> nn.Module:
        raise NotImplementedError


@dataclass(frozen=True)
class ShortConvConfig(RecurrentMixer):
    """A gated short convolution's kernel (and whether its projections have biases), and which layers are one."""

    layers: tuple[int, ...]
    kernel: int
    bias: bool = False

    def build(self, dims: int, eps: float) -> GatedShortConv:
        return GatedShortConv(dims, self.kernel, self.bias)


@dataclass(frozen=True)
class StateSpaceConfig(RecurrentMixer):
    """The sizes of a Mamba2 selective state-space layer, and which layers are one."""

    layers: tuple[int, ...]
    heads: int
    head_dims: int
    state_dims: int
    groups: int
    kernel: int
    conv_bias: bool = True
    bias: bool = False
    dt_limits: tuple[float, float] = (0.0, float("inf"))

    def build(self, dims: int, eps: float) -> SelectiveStateSpace:
        return SelectiveStateSpace(
            dims,
            self.heads,
            self.head_dims,
            self.state_dims,
            self.groups,
            self.kernel,
            eps,
            self.conv_bias,
            self.bias,
            self.dt_limits,
        )


@dataclass(frozen=True)
class DeltaNetConfig(RecurrentMixer):
    """The sizes of a Gated DeltaNet layer, and which layers are one."""

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_dims: int
    value_dims: int
    kernel: int

    def build(self, dims: int, eps: float) -> GatedDeltaNet:
        return GatedDeltaNet(dims, self.key_heads, self.value_heads, self.key_dims, self.value_dims, self.kernel, eps)


def conv_weights(weights: dict) -> dict:
    """Depthwise convolution weights as MLX reads them, (channels, kernel, 1): transformers writes (channels, 1,
    kernel)."""
    return {
        k: v.moveaxis(2, 1) if k.endswith(("conv.weight", "conv1d.weight")) and v.ndim == 3 and v.shape[-1] != 1 else v
        for k, v in weights.items()
    }


BLOCKS = {"before": Block, "after": PostNormBlock, "both": FourNormBlock}  # where a block's norms sit


@dataclass
class DecoderConfig:
    names = LLAMA_NAMES  # checkpoint names <-> the model's: Hugging Face and mlx-lm
    gguf_names = LLAMA_GGUF_NAMES  # llama.cpp's
    defaults = {}  # transformers' values for the config keys that a family's published configs may leave out
    fused = ()  # checkpoint modules that stack several projections' rows: "qkv_proj", "gate_up_proj"
    experts_layout = GATE_FIRST  # how Hugging Face checkpoints (and transformers) stack the routed experts' weights
    gguf_rows_permuted = False  # whether llama.cpp's converter reordered the q/k rows (LLaMA's files; not Qwen's)

    # read from every config
    vocab_size: int
    dims: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dims: int  # the features of each head that RoPE turns (the first `partial_rotary_factor` of them)
    ffn_dims: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    max_positions: int = 2048
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tied_head: bool = False
    # what the families differ by
    norm_class: type = RMSNorm  # of every norm in the model
    norms: str = "before"  # where a block's norms sit: "before" the sub-layers, "after" them, or "both" (four)
    qk_norm: bool = False  # queries and keys normed before RoPE: each head on its own, or all heads at once
    qk_norm_per_head: bool = True
    qk_norm_after_rope: bool = False  # set: the per-head norms come after RoPE, in the layers that rotate only
    qk_norm_class: type | None = None  # of the query and key norms, where it is not `norm_class`
    interleaved_rope: bool = False  # RoPE turns adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves
    unrotated_layers: tuple[int, ...] = ()  # layers that attend with no RoPE (the causal mask alone orders tokens)
    window: int | None = None  # each token sees itself and the `window - 1` tokens before it ...
    chunk: int | None = None  # ... or the tokens before it in its own chunk of this many ...
    global_layers: tuple[int, ...] = ()  # ... except in these layers, which see the whole text
    local_rope_base: float | None = None  # the windowed layers' own RoPE, where it differs
    local_rope_scaling: dict | None = None
    sinks: bool = False  # a learned logit per head joins the softmax
    query_scale: float | None = None  # scores are q k^T times it, not over sqrt(head_dim)
    attention_cap: float | None = None  # attention scores soft-capped at it
    logit_cap: float | None = None  # logits soft-capped at it
    logit_divisor: float | None = None  # logits divided by it
    residual_scale: float | None = None  # each sub-layer's output multiplied by it before it joins the residual
    embed_scale: float | None = None  # embedded tokens multiplied by it
    query_temperature: tuple | None = None  # (beta, span, shift): queries scaled with their position (QueryTemperature)
    temperature_layers: tuple[int, ...] | None = None  # the layers that scale them (None: every layer)
    activation: str = "silu"  # of the dense FFN's gate: a SwiGLU, or a GatedFFN with another activation
    moe: MoEConfig | None = None
    latent_dims: int = 0  # set: multi-head latent attention (DeepSeek) with these four sizes
    q_lora_rank: int | None = None
    nope_dims: int = 0
    value_dims: int = 0
    attn_output_gate: bool = False  # attention's output times sigmoid of a gate from q_proj's doubled width
    recurrent: "RecurrentMixer | None" = None  # the layers whose token-mixer is recurrent, and its kind and sizes
    index_top_k: int = 0  # set: latent attention sees the top-k keys a lightning indexer of these sizes chooses
    index_heads: int = 0
    index_head_dim: int = 0
    global_head_dim: int | None = None  # the global layers' own head width and kv heads, where they differ
    global_kv_heads: int | None = None
    global_values_from_keys: bool = False  # the global layers' values are their keys' projection (no v_proj)
    value_norm: bool = False  # each value head RMS-normed (no weight)
    kv_sources: tuple[tuple[int, int], ...] = ()  # (layer, source): the layer attends over the source's keys/values
    layer_input_dims: int = 0  # set: each layer reads an input of its own (PerLayerInputs) this wide ...
    layer_input_vocab: int = 0  # ... from a second embedding of this many tokens
    layer_scalar: bool = False  # each block's output times a learned scalar
    wide_ffn_layers: tuple[int, ...] = ()  # layers whose dense FFN is twice `ffn_dims` wide
    moe_beside_ffn: bool = False  # `moe` runs beside the dense FFN (LayerInputBlock) in every layer, not instead
    image_token: int | None = None  # the placeholder id whose runs an image's soft tokens replace (`image_encoder`)
    image_start_token: int | None = None  # the id a prompt writes where an image goes (`expand_images` follows it)

    @classmethod
    def from_config(cls, config: dict):
        """The keys every family reads, from a normalized config (the registry normalizes) and the family's
        `defaults`; a family's own `from_config` reads its other keys into fields with `dataclasses.replace`."""
        c = {**cls.defaults, **config}
        dims, heads = number(c, "hidden_size"), number(c, "num_attention_heads")
        kv_heads = number(c, "num_key_value_heads", heads)
        head_dim = number(c, "head_dim", dims // heads)
        require(
            heads % kv_heads == 0,
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})",
        )
        require(head_dim > 0, f"hidden_size ({dims}) is below num_attention_heads ({heads}) and no head_dim is given")
        rotary = number(c, "partial_rotary_factor", 1.0, float)
        require(rotary <= 1, f"partial_rotary_factor ({rotary}) must be at most 1")
        bias = flag(c, "attention_bias")
        return cls(
            vocab_size=number(c, "vocab_size"),
            dims=dims,
            layers=number(c, "num_hidden_layers", high=MAX_LAYERS),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dims=int(head_dim * rotary),
            ffn_dims=number(c, "intermediate_size"),
            norm_eps=number(c, "rms_norm_eps", 1e-5, float),
            rope_base=number(c, "rope_theta", 10000.0, float),
            rope_scaling=rope_scaling(c),
            max_positions=number(c, "max_position_embeddings", 2048),
            qkv_bias=bias,
            out_bias=bias,
            mlp_bias=flag(c, "mlp_bias"),
            tied_head=flag(c, "tie_word_embeddings"),
        )

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return self.window is not None and layer not in self.global_layers

    def chunked(self, layer: int) -> bool:
        return self.chunk is not None and layer not in self.global_layers

    def heads_of(self, layer: int) -> tuple[int, int]:
        """Layer `layer`'s kv heads and head width: the global layers' own where they have them."""
        if self.global_head_dim is None or self.sliding(layer):
            return self.kv_heads, self.head_dim
        return self.global_kv_heads or self.kv_heads, self.global_head_dim

    def rope(self, layer: int) -> RoPE | None:
        """Layer `layer`'s RoPE: over `rotary_dims` (of its heads' width), the windowed layers' own base and scaling
        where they have them."""
        if layer in self.unrotated_layers:
            return None
        local = self.local_rope_base is not None and self.sliding(layer)
        base, scaling = (
            (self.local_rope_base, self.local_rope_scaling) if local else (self.rope_base, self.rope_scaling)
        )
        dims = self.rotary_dims * self.heads_of(layer)[1] // self.head_dim
        return RoPE(dims, base, scaling, self.max_positions, self.interleaved_rope)

    def attention(self, layer: int) -> nn.Module:
        """Layer `layer`'s token-mixer: grouped-query attention (multi-head when `kv_heads == heads`), latent
        attention when `latent_dims`, or a recurrent mixer in the layers `recurrent` covers."""
        if self.recurrent is not None and layer in self.recurrent.layers:
            return self.recurrent.build(self.dims, self.norm_eps)
        if self.latent_dims:
            return LatentAttention(
                self.dims,
                self.heads,
                self.q_lora_rank,
                self.latent_dims,
                self.nope_dims,
                self.rotary_dims,
                self.value_dims,
                self.rope(layer),
                self.query_scale,
                self.qkv_bias,
                query_temperature=self.temperature(layer),
                indexer=self.indexer() if self.index_top_k else None,
            )
        rope = self.rope(layer)
        qk_norm = self.qk_norm and (rope is not None or not self.qk_norm_after_rope)
        kv_heads, head_dim = self.heads_of(layer)
        sources = dict(self.kv_sources)
        if layer in sources:
            return SharedKVAttention(
                self.dims,
                self.heads,
                head_dim,
                sources[layer],
                rope,
                self.norm_eps if qk_norm else None,
                self.query_scale,
                self.qk_norm_class or self.norm_class,
            )
        return Attention(
            self.dims,
            self.heads,
            kv_heads,
            head_dim,
            rope,
            self.qkv_bias,
            self.out_bias,
            qk_norm_eps=self.norm_eps if qk_norm else None,
            qk_norm_per_head=self.qk_norm_per_head,
            window=self.window if self.sliding(layer) else None,
            sinks=self.sinks,
            scale=self.query_scale,
            logit_cap=self.attention_cap,
            qk_norm=self.qk_norm_class or self.norm_class,
            query_temperature=self.temperature(layer),
            chunk=self.chunk if self.chunked(layer) else None,
            qk_norm_after_rope=self.qk_norm_after_rope,
            output_gate=self.attn_output_gate,
            values_from_keys=self.global_values_from_keys and not self.sliding(layer),
            value_norm_eps=self.norm_eps if self.value_norm else None,
            lends=layer if layer in sources.values() else None,
        )

    def indexer(self) -> Indexer:
        """The top-k key chooser of sparse latent attention: its own RoPE on rotate-half pairs, the attention's
        angles."""
        rope = RoPE(self.rotary_dims, self.rope_base, self.rope_scaling, self.max_positions)
        return Indexer(self.dims, self.q_lora_rank, self.index_heads, self.index_head_dim, rope, self.index_top_k)

    def temperature(self, layer: int) -> QueryTemperature | None:
        """Layer `layer`'s position-dependent query scale, where it has one."""
        scaled = self.temperature_layers is None or layer in self.temperature_layers
        return QueryTemperature(*self.query_temperature) if self.query_temperature and scaled else None

    def ffn(self, layer: int) -> nn.Module:
        """The dense gated FFN, or a mixture of experts in the layers `moe` covers (unless it runs beside the FFN)."""
        if self.moe is not None and self.moe.covers(layer) and not self.moe_beside_ffn:
            return self.moe.build(self.dims, self.mlp_bias)
        ffn_dims = self.ffn_dims * (2 if layer in self.wide_ffn_layers else 1)
        if self.activation == "silu":
            return SwiGLU(self.dims, ffn_dims, bias=self.mlp_bias)
        return GatedFFN(self.dims, ffn_dims, self.activation, self.mlp_bias)

    def block(self, layer: int) -> Block:
        """Layer `layer`'s attention and FFN, wired to the residual stream with their norms where `norms` puts them."""
        attn, ffn = self.attention(layer), self.ffn(layer)
        if self.layer_scalar or self.layer_input_dims or self.moe_beside_ffn:
            beside = self.moe_beside_ffn and self.moe.covers(layer)
            norms = [
                self.norm_class(self.dims, self.norm_eps) for _ in range(4 + 2 * beside + bool(self.layer_input_dims))
            ]
            moe = self.moe.build(self.dims, self.mlp_bias) if beside else None
            activation = ACTIVATIONS[self.activation]
            return LayerInputBlock(attn, ffn, norms, layer, self.dims, moe, self.layer_input_dims, activation)
        norms = [self.norm_class(self.dims, self.norm_eps) for _ in range(4 if self.norms == "both" else 2)]
        if self.residual_scale is not None:
            return BLOCKS[self.norms](attn, ffn, *norms, residual_scale=self.residual_scale)
        return BLOCKS[self.norms](attn, ffn, *norms)

    def build(self) -> Transformer:
        blocks = [self.block(i) for i in range(self.layers)]
        head = None if self.tied_head else nn.Linear(self.dims, self.vocab_size, bias=False)
        norm = self.norm_class(self.dims, self.norm_eps)
        embed = nn.Embedding(self.vocab_size, self.dims)
        layer_inputs = None
        if self.layer_input_dims:
            layer_inputs = PerLayerInputs(
                self.layer_input_vocab, self.dims, self.layers, self.layer_input_dims, self.norm_eps
            )
        return Transformer(
            embed,
            blocks,
            norm,
            head,
            embed_scale=self.embed_scale,
            logit_cap=self.logit_cap,
            logit_divisor=self.logit_divisor,
            layer_inputs=layer_inputs,
            blocks_apart=not (self.kv_sources or self.layer_input_dims or self.moe_beside_ffn),
            vision=self.image_encoder(),
        )

    recurrent_module: ClassVar[str | None] = None
    """mlx-lm's name of the recurrent layers' token-mixer (`linear_attn`, `conv`, `mamba`), which the names table
    gives every layer's mixer; None for a family whose recurrent layers `minimlx convert` cannot write."""

    def image_encoder(self) -> nn.Module | None:
        """The image encoder (`core.vision.ImageEncoder`) of a family that reads images (its soft tokens join the
        prompt), None for text only."""
        return None

    def image_processor(self, settings: dict):
        """The family's image processor (`minimlx.vision.ImageProcessor`) from its saved `settings`
        (`preprocessor_config.json`); only a family with an `image_encoder` has one."""
        raise NotImplementedError(f"{type(self).__name__} reads no images")

    images_both_ways: ClassVar[bool] = False  # whether an image's soft tokens see each other both ways
    images_both_ways_windowed_only: ClassVar[bool] = False  # ... in sliding-window layers only (global: causal)
    image_stand_in: ClassVar[int | None] = None  # the token an image's places read as for the per-layer inputs

    def place_images(self, ids, features, places: Sequence[int], axes=None):
        """`features` (the soft tokens of images of `places` places) placed in a prompt's `ids` as the family reads
        them (`core.vision.PlacedImages`): both ways or not, the per-layer inputs' stand-in, `axes` (`image_axes`)."""
        return PlacedImages.at(
            ids,
            self.image_token,
            features,
            places,
            self.images_both_ways,
            axes,
            windowed_only=self.images_both_ways_windowed_only,
            stand_in=self.image_stand_in,
        )

    def image_places(self, image) -> int:
        """How many places (soft tokens) one image (an `ImageInput`) takes in the prompt."""
        raise NotImplementedError(f"{type(self).__name__} reads no images")

    def image_runs(self, image) -> tuple[int, ...]:
        """The lengths of the runs of `image_token` one image's places make in the prompt, in order: one run of
        `image_places`, unless the family's layout breaks them with other tokens (rows ended by a break token)."""
        return (self.image_places(image),)

    def image_grids(self, image) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(the encoder's patches, the soft tokens) of one image as (rows, columns) over the picture, its soft tokens
        row-major in one run (what the explainer draws over the picture); None where the family's layout is not
        such a grid."""
        return None

    def with_tokenizer(self, tokenizer) -> "DecoderConfig":
        """This config with what it needs of the model's tokenizer to write image places (a family whose places
        are written with tokens its config does not name, such as Idefics3's tile tokens); as it is for most."""
        return self

    def image_axes(self, ids: list[int], images: Sequence):
        """(3, tokens) positions of a prompt's tokens along each axis of a multimodal RoPE (its images' tokens on
        their grid), or None where positions are the tokens' indices (these)."""
        return None

    def expand_images(self, ids: list[int], images: Sequence = ()) -> list[int]:
        """A prompt's ids with each image's places for its soft tokens written out (`images`: its `ImageInput`s, in
        order), as the family's processor writes them (these: as given)."""
        return ids

    def write_images_text(self, text: str) -> str:
        """A text prompt holding images (after its chat template) as the family's processor rewrites it before
        tokenizing, where that rewrite adds text the tokenizer merges with its neighbours (Gemma 3's blank lines);
        as it is for most, whose places `expand_images` writes out in the ids. A place already written out is kept."""
        return text

    def fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        """The checkpoint's fused modules (`fused`), each with the projections it stacks and their rows."""
        kv_rows = self.kv_heads * self.head_dim
        parts = {
            "qkv_proj": [("q_proj", self.heads * self.head_dim), ("k_proj", kv_rows), ("v_proj", kv_rows)],
            "gate_up_proj": [("gate_proj", self.ffn_dims), ("up_proj", self.ffn_dims)],
        }
        return {fused: parts[fused] for fused in self.fused}

    def convert_weights(self, weights: dict) -> dict:
        """Hugging Face or mlx-lm tensors -> the model's: renamed, a tied model's stray lm_head dropped, experts
        stacked, fused projections split."""
        weights = self.names.to_ours(weights)
        if self.recurrent is not None:
            weights = conv_weights(weights)
        weights = {k: v for k, v in weights.items() if not (self.tied_head and k.startswith("head."))}
        if self.moe is not None:
            weights = stack_experts(weights)
        for fused, parts in self.fused_parts().items():
            weights = split_fused(weights, fused, parts)
        return weights

    def export_weights(self, weights: dict) -> dict:
        """The model's tensors under the names mlx-lm reads (what `minimlx convert` writes), fused projections joined
        again."""
        for fused, parts in self.fused_parts().items():
            weights = fuse(weights, fused, [part for part, _ in parts])
        return self.exported_names(weights)

    def export_config(self, config: dict) -> dict:
        """The config.json written with the tensors of `export_weights`: the checkpoint's, which mlx-lm reads as it is
        for the families whose keys are the same."""
        return config

    def exported_names(self, weights: dict) -> dict:
        """The names table's mlx-lm names; in a hybrid model the attending layers' tensors under `self_attn`, where the
        table (one prefix per layer) names them as the recurrent mixer's (`recurrent_module`)."""
        if self.recurrent is None:
            return self.names.to_theirs(weights)
        if self.recurrent_module is None:
            raise UnsupportedArchitectureError(
                "minimlx convert cannot write this family's recurrent layers yet (their mlx-lm names and layouts are "
                "not mapped); load the Hugging Face folder directly"
            )
        recurrent = {str(i) for i in self.recurrent.layers}
        mixer = re.compile(rf"(^|\.)layers\.(\d+)\.{self.recurrent_module}\.")

        def named(name: str) -> str:  # under whatever prefix the names have (an image-text model's too)
            found = mixer.search(name)
            if found is None or found[2] in recurrent:
                return name
            return f"{name[: found.start()]}{found[1]}layers.{found[2]}.self_attn.{name[found.end() :]}"

        return {named(k): v for k, v in self.names.to_theirs(weights).items()}

    def export_hf_weights(self, weights: dict) -> dict:
        """The model's float tensors under the names and layouts transformers reads (`minimlx fuse` to a Hugging
        Face folder): mlx-lm's, for the families whose layouts are the same (not the recurrent layers': their
        convolutions and norms are stored otherwise)."""
        if self.recurrent is not None:
            raise UnsupportedArchitectureError(
                "minimlx cannot write this family's recurrent layers in transformers' layout yet; write an MLX folder"
            )
        return self.export_weights(weights)

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """The config of a llama.cpp file whose architecture is named as the family's model_type (`qwen2`, `qwen3`):
        llama.cpp's LLaMA keys. A family reads such files when it lists the name in `gguf_architectures`."""
        return llama_config(metadata, tensors, metadata["general.architecture"])

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's names -> the model's; fused projections split (`gguf_names` maps llama.cpp's `attn_qkv` and
        fused `ffn_up` onto the checkpoint's fused modules); q/k rows back in rotate-half order where its converter
        permuted them."""
        weights = self.gguf_names.to_ours(tensors)
        for fused, parts in self.fused_parts().items():
            weights = split_fused(weights, fused, parts)
        if self.gguf_rows_permuted:
            for name, w in weights.items():
                if ".attn.q_proj." in name or ".attn.k_proj." in name:
                    weights[name] = unpermute_rows(w, self.heads if ".q_proj." in name else self.kv_heads)
        return weights
