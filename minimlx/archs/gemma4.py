"""Gemma 4 (text, and the text part of Gemma 4's image-text checkpoints).

Gemma 3's four-norm block and its sliding and global layers, with these changes:

- the global layers have heads of their own width (`per_layer_config`, or `global_head_dim` and
  `num_global_key_value_heads`), and RoPE over them that turns only the first `partial_rotary_factor` of its
  frequencies (transformers' "proportional" RoPE); with `attention_k_eq_v` their values are their keys' projection;
- queries, keys and values are RMS-normed per head (the values with no weight) and the scores are not scaled;
- the last `num_kv_shared_layers` layers compute no keys or values: each attends over those of the last earlier
  layer of its kind (sliding or global), whose cache holds them; with `use_double_wide_mlp` their FFN is twice as wide;
- each layer reads an input of its own (`hidden_size_per_layer_input`: per-layer input embeddings), added through a
  gated projection after both sub-layers, and its output is multiplied by a learned `layer_scalar`;
- with `enable_moe_block`, a mixture of GELU experts runs beside each dense FFN (routed from the residual stream
  through a scaled RMSNorm, the chosen weights renormalised and scaled per expert);
- norms multiply by their weight (not 1 + weight); the logits are soft-capped by `final_logit_softcapping`.

llama.cpp's `gemma4` files give the global layers' head width as `attention.key_length` (the sliding ones' as
`key_length_swa`), kv heads and FFN widths per layer, the global RoPE's frozen frequencies as `rope_freqs` factors of
1e30 (read as per-frequency scaling: the same angles), the experts' gate and up projections fused.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from ..core import RMSNorm
from ..core.ffn import ACTIVATIONS
from ..core.pooled_grid_vision import PooledGridEncoder
from ..errors import UnsupportedArchitectureError
from .config import choice, flag, number, require, rope_scaling
from .decoder import DecoderConfig
from .experts import MoEConfig
from .gguf import Metadata, llama_config, windows
from .image_text import ImageText, text_model_names, with_vision_names, write_out_images
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES, POST_NORM_GGUF_NAMES
from .registry import register

GEMMA4_NAMES = LLAMA_NAMES.extended(
    [
        ("model.embed_tokens_per_layer.", "layer_inputs.embed."),
        ("model.per_layer_model_projection.", "layer_inputs.proj."),
        ("model.per_layer_projection_norm.", "layer_inputs.norm."),
        ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.post_attn_norm."),
        ("model.layers.{i}.pre_feedforward_layernorm_2.", "layers.{i}.moe.input_norm."),
        ("model.layers.{i}.post_feedforward_layernorm_1.", "layers.{i}.post_dense_norm."),
        ("model.layers.{i}.post_feedforward_layernorm_2.", "layers.{i}.post_moe_norm."),
        ("model.layers.{i}.pre_feedforward_layernorm.", "layers.{i}.ffn_norm."),
        ("model.layers.{i}.post_feedforward_layernorm.", "layers.{i}.post_ffn_norm."),
        ("model.layers.{i}.router.scale", "layers.{i}.moe.router.input_scale"),
        ("model.layers.{i}.router.per_expert_scale", "layers.{i}.moe.router.expert_scale"),
        ("model.layers.{i}.router.", "layers.{i}.moe.router."),
        ("model.layers.{i}.experts.switch_glu.", "layers.{i}.moe.experts."),
        ("model.layers.{i}.experts.", "layers.{i}.moe.experts."),
        ("model.layers.{i}.per_layer_input_gate.", "layers.{i}.input_gate."),
        ("model.layers.{i}.per_layer_projection.", "layers.{i}.input_proj."),
        ("model.layers.{i}.post_per_layer_input_norm.", "layers.{i}.input_norm."),
        ("model.layers.{i}.layer_scalar", "layers.{i}.layer_scalar"),
    ],
    drop=[r"\.self_attn\.rotary_emb\."],
)
GEMMA4_GGUF_NAMES = LLAMA_GGUF_NAMES.extended(
    [
        *POST_NORM_GGUF_NAMES,
        ("per_layer_token_embd.", "layer_inputs.embed."),
        ("per_layer_model_proj.", "layer_inputs.proj."),
        ("per_layer_proj_norm.", "layer_inputs.norm."),
        ("blk.{i}.inp_gate.", "layers.{i}.input_gate."),
        ("blk.{i}.proj.", "layers.{i}.input_proj."),
        ("blk.{i}.post_norm.", "layers.{i}.input_norm."),
        ("blk.{i}.layer_output_scale.weight", "layers.{i}.layer_scalar"),
        ("blk.{i}.ffn_gate_inp_scale", "layers.{i}.moe.router.input_scale"),
        ("blk.{i}.ffn_gate_inp.", "layers.{i}.moe.router.proj."),
        ("blk.{i}.ffn_down_exps_scale", "layers.{i}.moe.router.expert_scale"),
        ("blk.{i}.ffn_gate_up_exps.", "layers.{i}.moe.experts.gate_up_proj."),
        ("blk.{i}.ffn_down_exps.", "layers.{i}.moe.experts.down_proj."),
        ("blk.{i}.pre_ffw_norm_2.", "layers.{i}.moe.input_norm."),
        ("blk.{i}.post_ffw_norm_1.", "layers.{i}.post_dense_norm."),
        ("blk.{i}.post_ffw_norm_2.", "layers.{i}.post_moe_norm."),
    ],
    drop=[r"^(v|mm|a)\."],
)
SCALES = re.compile(r"^(blk\.\d+\.(?:ffn_gate_inp|ffn_down_exps))\.scale$")
KV_PARTS = (".attn.k_proj.", ".attn.v_proj.", ".attn.k_norm.", ".attn.v_norm.")


def global_heads(c: dict, kinds: list[str], head_dim: int, kv_heads: int) -> tuple[int, int]:
    """The global layers' head width and kv heads: `per_layer_config` (one override for every global layer, none for
    the others), else `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads`."""
    overrides = c.get("per_layer_config")
    if overrides is None:
        width = number(c, "global_head_dim", 512)
        heads = number(c, "num_global_key_value_heads", None) if flag(c, "attention_k_eq_v", True) else None
        return width, heads or kv_heads
    require(isinstance(overrides, dict), "per_layer_config must map layer numbers to settings")
    chosen = {int(layer): setting for layer, setting in overrides.items()}
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    require(
        set(chosen) <= set(full) and all(chosen.get(i) == chosen.get(full[0]) for i in full),
        "per_layer_config must give every full_attention layer the same settings and no other layer any",
    )
    setting = chosen.get(full[0]) or {}
    unknown = set(setting) - {"head_dim", "num_key_value_heads"}
    if unknown:
        raise UnsupportedArchitectureError(f"per_layer_config sets {sorted(unknown)}, which minimlx does not support")
    return number(setting, "head_dim", head_dim), number(setting, "num_key_value_heads", kv_heads)


def kv_sources(kinds: list[str], shared: int) -> tuple[tuple[int, int], ...]:
    """(layer, source) for each of the last `shared` layers: the last earlier layer of its kind that computes keys
    and values."""
    layers = len(kinds)
    require(
        0 <= shared < layers,
        f"num_kv_shared_layers ({shared}) must be below num_hidden_layers ({layers}): a shared layer reads the keys "
        "and values of an earlier layer of the stack",
    )
    first = layers - shared
    sources = []
    for layer in range(first, layers):
        earlier = [i for i in range(first) if kinds[i] == kinds[layer]]
        require(
            bool(earlier),
            f"layer {layer} ({kinds[layer]}) shares keys and values, but no earlier one of its kind has any",
        )
        sources.append((layer, earlier[-1]))
    return tuple(sources)


@register("gemma4_text")
@dataclass
class Gemma4TextConfig(DecoderConfig):
    example_config = {
        "model_type": "gemma4_text",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "global_head_dim": 16,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 4,
        "vocab_size_per_layer_input": 64,
    }
    names = GEMMA4_NAMES
    gguf_architectures = ("gemma4",)
    gguf_names = GEMMA4_GGUF_NAMES
    # transformers' values for the keys published configs may leave out
    defaults = {
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "sliding_window": 512,
        "head_dim": 256,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
    }

    norm_class: type = RMSNorm
    norms: str = "both"
    qk_norm: bool = True
    value_norm: bool = True
    layer_scalar: bool = True

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config}
        if c.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": the image-text model's (below)
            raise UnsupportedArchitectureError("bidirectional Gemma 4 (use_bidirectional_attention) is not supported")
        if "rope_theta" not in config:  # transformers' RoPE for each kind
            c["rope_scaling"], c["partial_rotary_factor"] = {"rope_type": "proportional"}, 0.25
        scaling = rope_scaling(c)
        if scaling is not None and scaling["rope_type"] == "proportional":  # turns part of the frequencies, not dims
            scaling = {**scaling, "partial_rotary_factor": c.pop("partial_rotary_factor", 1.0)}
        arch = super().from_config(c)
        layers = arch.layers
        kinds = c.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)
        ]
        require(
            isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {"sliding_attention", "full_attention"},
            f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} layers",
        )
        kinds = [*kinds[:-1], "full_attention"]  # as transformers: the last layer sees the whole text
        global_head_dim, global_kv_heads = global_heads(c, kinds, arch.head_dim, arch.kv_heads)
        require(
            arch.heads % global_kv_heads == 0,
            f"num_attention_heads ({arch.heads}) must be a multiple of the global layers' kv heads ({global_kv_heads})",
        )
        sources = kv_sources(kinds, number(c, "num_kv_shared_layers", 0, low=0))
        shared = tuple(layer for layer, _ in sources)
        moe = None
        if flag(c, "enable_moe_block"):
            experts = number(c, "num_experts")
            chosen = number(c, "top_k_experts")
            require(chosen <= experts, f"top_k_experts ({chosen}) must be at most num_experts ({experts})")
            moe = MoEConfig(
                experts,
                chosen,
                number(c, "moe_intermediate_size"),
                normalize=True,
                activation=choice(c, "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS),
                input_norm_eps=arch.norm_eps,
                expert_scale=True,
            )
        input_dims = number(c, "hidden_size_per_layer_input", 0, low=0)
        return replace(
            arch,
            rope_scaling=scaling,
            activation=choice(c, "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS),
            query_scale=1.0,
            window=number(c, "sliding_window"),
            global_layers=tuple(i for i, kind in enumerate(kinds) if kind == "full_attention"),
            local_rope_base=number(c, "rope_local_base_freq", None, float),
            local_rope_scaling=rope_scaling(c, "rope_local_scaling"),
            logit_cap=number(c, "final_logit_softcapping", None, float),
            embed_scale=arch.dims**0.5,
            global_head_dim=global_head_dim,
            global_kv_heads=global_kv_heads,
            global_values_from_keys=flag(c, "attention_k_eq_v"),
            kv_sources=sources,
            wide_ffn_layers=shared if flag(c, "use_double_wide_mlp") else (),
            layer_input_dims=input_dims,
            layer_input_vocab=number(c, "vocab_size_per_layer_input") if input_dims else 0,
            moe=moe,
            moe_beside_ffn=moe is not None,
        )

    def convert_weights(self, weights: dict) -> dict:
        """The checkpoint's tensors, less the key and value parts some checkpoints keep for the shared layers."""
        return self.without_shared_kv(super().convert_weights(weights))

    def without_shared_kv(self, weights: dict) -> dict:
        shared = tuple(f"layers.{layer}." for layer, _ in self.kv_sources)
        return {k: v for k, v in weights.items() if not (k.startswith(shared) and any(p in k for p in KV_PARTS))}

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        config = {**llama_config(metadata, tensors, "gemma4_text"), **windows(m, 6)}
        kinds = config.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(config["num_hidden_layers"])
        ]
        full = kinds.index("full_attention")
        ffn, kv = m["feed_forward_length"], config["num_key_value_heads"]
        ffn, kv = (ffn if isinstance(ffn, list) else [ffn]), (kv if isinstance(kv, list) else [kv] * len(kinds))
        shared = m.get("attention.shared_kv_layers", 0)
        input_dims = m.get("embedding_length_per_layer_input", 0)
        config.update(
            intermediate_size=ffn[0],
            use_double_wide_mlp=bool(shared) and ffn[-1] == 2 * ffn[0],
            num_kv_shared_layers=shared,
            head_dim=m.get("attention.key_length_swa", config["head_dim"]),
            global_head_dim=config["head_dim"],
            num_key_value_heads=kv[kinds.index("sliding_attention")] if "sliding_attention" in kinds else kv[0],
            num_global_key_value_heads=kv[full],
            attention_k_eq_v=f"blk.{full}.attn_v.weight" not in tensors,
            rope_local_base_freq=m.get("rope.freq_base_swa", 10000.0),
            final_logit_softcapping=m.get("final_logit_softcapping"),
            hidden_size_per_layer_input=input_dims,
        )
        if input_dims:
            config["vocab_size_per_layer_input"] = tensors["per_layer_token_embd.weight"].shape[0]
        if m.get("expert_count"):
            config.update(
                enable_moe_block=True,
                num_experts=m["expert_count"],
                top_k_experts=m["expert_used_count"],
                moe_intermediate_size=m["expert_feed_forward_length"],
            )
        return config

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """llama.cpp's tensors, the experts' fused gate and up projections split (each of a packed one's arrays by
        rows), the shared layers' key and value parts dropped."""
        # the router's `.scale` vectors, named apart from a packed tensor's `.scales`
        tensors = {SCALES.sub(r"\1_scale", name): w for name, w in tensors.items()}
        weights = {}
        for name, w in super().convert_gguf_weights(tensors, metadata).items():
            if ".experts.gate_up_proj." in name:
                gate, up = mx.split(w, 2, axis=-2)
                weights[name.replace("gate_up_proj", "gate_proj")] = gate
                weights[name.replace("gate_up_proj", "up_proj")] = up
            else:
                weights[name] = w
        return self.without_shared_kv(weights)


VISION_TOWER_NAMES = [
    ("patch_embedder.input_proj.", "vision.embed.proj."),
    ("patch_embedder.position_embedding_table", "vision.embed.position_table"),
    ("encoder.layers.{i}.input_layernorm.", "vision.layers.{i}.attn_norm."),
    ("encoder.layers.{i}.post_attention_layernorm.", "vision.layers.{i}.post_attn_norm."),
    ("encoder.layers.{i}.pre_feedforward_layernorm.", "vision.layers.{i}.ffn_norm."),
    ("encoder.layers.{i}.post_feedforward_layernorm.", "vision.layers.{i}.post_ffn_norm."),
    ("encoder.layers.{i}.self_attn.", "vision.layers.{i}.attn."),
    ("encoder.layers.{i}.mlp.", "vision.layers.{i}.ffn."),  # each map's `.linear.` and, clipped, its bounds
    ("std_bias", "vision.std_bias"),
    ("std_scale", "vision.std_scale"),
]
VISION_PROJECTOR_NAMES = [("embed_vision.embedding_projection.", "vision.projection.")]
AUDIO = [r"(^|\.)audio_tower\.", r"(^|\.)embed_audio\."]


@dataclass(frozen=True)
class Gemma4VisionSettings:
    """Gemma 4's vision tower (`vision_config`): its sizes, patches and the squares pooled into each soft token."""

    dims: int
    ffn_dims: int
    layers: int
    heads: int
    head_dims: int
    patch: int
    pooling: int
    table_size: int
    rope_base: float
    eps: float
    activation: str
    standardize: bool
    clipped: bool  # each block's linear maps clamp their input and output

    @classmethod
    def from_config(cls, v: dict) -> "Gemma4VisionSettings":
        heads = number(v, "num_attention_heads", 12)
        require(
            number(v, "num_key_value_heads", heads) == heads,
            "the Gemma 4 vision tower's num_key_value_heads must equal its num_attention_heads",
        )
        rope = v.get("rope_parameters") or {}
        return cls(
            dims=number(v, "hidden_size", 768),
            ffn_dims=number(v, "intermediate_size", 3072),
            layers=number(v, "num_hidden_layers", 16),
            heads=heads,
            head_dims=number(v, "head_dim", 64),
            patch=number(v, "patch_size", 16),
            pooling=number(v, "pooling_kernel_size", 3),
            table_size=number(v, "position_embedding_size", 10240),
            rope_base=float(rope.get("rope_theta", 100.0)),
            eps=number(v, "rms_norm_eps", 1e-6, float),
            activation=choice(v, "hidden_activation", "gelu_pytorch_tanh", ACTIVATIONS),
            standardize=flag(v, "standardize"),
            clipped=flag(v, "use_clipped_linears"),
        )


@register("gemma4")
@dataclass
class Gemma4Config(ImageText, Gemma4TextConfig):
    """Gemma 4's image-text checkpoints: the text model (tied unless the checkpoint says not) and, where the config
    has a `vision_config`, the vision tower whose soft tokens stand at the image token's places; the audio tower is
    skipped. The prompt writes the image token once per image; it is written out as the processor does: the image
    start token, one image token per soft token, the image end token. With the text model's
    `use_bidirectional_attention: "vision"`, an image's tokens see each other both ways in the sliding layers (the
    global ones read them causally); the per-layer inputs read an image's places as the padding token."""

    example_config = {"model_type": "gemma4", "text_config": Gemma4TextConfig.example_config}
    names = with_vision_names(
        text_model_names(GEMMA4_NAMES),
        ("model.vision_tower.", "vision_tower."),
        VISION_TOWER_NAMES,
        VISION_PROJECTOR_NAMES,
        drop=[r"\.self_attn\.rotary_emb\.", *AUDIO],
    )
    image_text_type = "gemma4"
    inherited = {"tie_word_embeddings": True}
    reads_images = True
    images_both_ways_windowed_only = True

    vision: Gemma4VisionSettings | None = None
    vision_both_ways: bool = False
    pad_token: int = 0
    image_token: int = 258880
    image_start_token: int = 258880  # the prompt writes the image token itself where an image goes
    image_begin_token: int = 255999
    image_end_token: int = 258882

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return arch
        text = config.get("text_config") or {}
        image = number(config, "image_token_id", 258880, low=0)
        return replace(
            arch,
            vision=Gemma4VisionSettings.from_config(vision),
            vision_both_ways=text.get("use_bidirectional_attention") == "vision",
            pad_token=number(text, "pad_token_id", 0, low=0),
            image_token=image,
            image_start_token=image,
            image_begin_token=number(config, "boi_token_id", 255999, low=0),
            image_end_token=number(config, "eoi_token_id", 258882, low=0),
        )

    @property
    def images_both_ways(self) -> bool:
        return self.vision_both_ways

    @property
    def image_stand_in(self) -> int:
        return self.pad_token

    def image_encoder(self) -> PooledGridEncoder | None:
        v = self.vision
        if v is None:
            return None
        return PooledGridEncoder(
            v.dims,
            v.ffn_dims,
            v.layers,
            v.heads,
            v.head_dims,
            3 * v.patch * v.patch,
            v.table_size,
            v.pooling,
            self.dims,
            v.rope_base,
            v.eps,
            v.activation,
            v.standardize,
            v.clipped,
        )

    def image_processor(self, settings: dict):
        from ..vision.patches import PooledPatches

        return PooledPatches.from_config(settings)

    def image_places(self, image) -> int:
        rows, cols = image.grid
        return rows * cols // self.vision.pooling**2

    def image_grids(self, image) -> tuple[tuple[int, int], tuple[int, int]]:
        """The picture's patches and its pooled soft tokens, both row-major over it."""
        rows, cols = image.grid
        return (rows, cols), (rows // self.vision.pooling, cols // self.vision.pooling)

    def expand_images(self, ids: list[int], images: Sequence = ()) -> list[int]:
        """Each image token the chat template writes (one per image) written out as the processor does: the image
        start token, the image's places, the image end token; images already written out are kept."""
        return write_out_images(ids, images, self.image_token, self.image_layout)

    def image_layout(self, image) -> list[int]:
        """An image's ids in the prompt: its start token, a place per soft token, its end token."""
        return [self.image_begin_token, *[self.image_token] * self.image_places(image), self.image_end_token]
