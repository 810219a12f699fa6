"""LFM2: LLaMA's block where most layers' token-mixer is a gated short convolution (`layer_types` "conv", or every
layer not in `full_attn_idxs`) and the others attend with each query and key head RMS-normed. Its FFN's width is
adjusted from `intermediate_size` (two thirds, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`)
when `block_auto_adjust_ff_dim`; its final norm is called `embedding_norm`.

llama.cpp's converter (`lfm2`) writes the FFN's adjusted width, marks the convolution layers by zero key-value heads
(`attention.head_count_kv` one entry per layer) and stores each convolution as (channels, kernel).
"""

from dataclasses import dataclass, replace

from ..errors import UnsupportedArchitectureError
from .config import flag, number, recurrent_layers
from .decoder import DecoderConfig, ShortConvConfig
from .gguf import Metadata, hybrid_layers, llama_config
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES
from .registry import register


def ffn_dims(config: dict) -> int:
    """transformers' Lfm2MLP width."""
    dims = number(config, "intermediate_size")
    if not flag(config, "block_auto_adjust_ff_dim", True):
        return dims
    dims = int(2 * dims / 3)
    multiplier = number(config, "block_ffn_dim_multiplier", None, float)
    if multiplier is not None:
        multiple = number(config, "block_multiple_of", 256)
        dims = (int(multiplier * dims) + multiple - 1) // multiple * multiple
    return dims


def conv_layers(config: dict, layers: int) -> tuple[int, ...]:
    kinds = config.get("layer_types")
    if kinds is None:
        attention = config.get("full_attn_idxs")
        attention = range(layers) if attention is None else attention
        kinds = ["full_attention" if i in attention else "conv" for i in range(layers)]
    return recurrent_layers(kinds, layers, ("conv",), ("full_attention",))


@register("lfm2")
@dataclass
class Lfm2Config(DecoderConfig):
    example_config = {
        "model_type": "lfm2",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "layer_types": ["conv", "full_attention", "conv", "conv"],
    }
    names = LLAMA_NAMES.extended(
        [
            ("model.embedding_norm.", "norm."),
            ("model.layers.{i}.self_attn.out_proj.", "layers.{i}.attn.o_proj."),
            ("model.layers.{i}.self_attn.q_layernorm.", "layers.{i}.attn.q_norm."),
            ("model.layers.{i}.self_attn.k_layernorm.", "layers.{i}.attn.k_norm."),
            ("model.layers.{i}.conv.conv.", "layers.{i}.attn.conv1d."),
            ("model.layers.{i}.conv.", "layers.{i}.attn."),
            ("model.layers.{i}.operator_norm.", "layers.{i}.attn_norm."),
            ("model.layers.{i}.ffn_norm.", "layers.{i}.ffn_norm."),
            ("model.layers.{i}.feed_forward.w1.", "layers.{i}.ffn.gate_proj."),
            ("model.layers.{i}.feed_forward.w3.", "layers.{i}.ffn.up_proj."),
            ("model.layers.{i}.feed_forward.w2.", "layers.{i}.ffn.down_proj."),
        ]
    )
    defaults = {"rope_theta": 1000000.0, "tie_word_embeddings": True}

    qk_norm: bool = True

    @classmethod
    def from_config(cls, config: dict):
        c = {**cls.defaults, **config, "rms_norm_eps": config.get("norm_eps", 1e-5)}
        arch = super().from_config(c)
        mixer = ShortConvConfig(conv_layers(c, arch.layers), number(c, "conv_L_cache", 3), flag(c, "conv_bias"))
        return replace(arch, ffn_dims=ffn_dims(c), recurrent=mixer)

    recurrent_module = "conv"

    def export_config(self, config: dict) -> dict:
        """The config with every key mlx-lm's LFM2 requires (transformers' defaults where the checkpoint leaves one
        out) and the FFN's width as the model has it, not to be adjusted again (the same width in minimlx, mlx-lm and
        transformers whichever adjustment keys the checkpoint had). mlx-lm's LFM2 has no head of its own: a checkpoint
        that has one is refused."""
        if not self.tied_head:
            raise UnsupportedArchitectureError(
                "mlx-lm's LFM2 always ties its head to the embedding, so this checkpoint's own lm_head cannot be "
                "written as an MLX folder; load the checkpoint directly"
            )
        required = {
            "max_position_embeddings": 128000,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": self.dims,
            "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0,
        }
        width = {"block_auto_adjust_ff_dim": False, "intermediate_size": self.ffn_dims, "block_ff_dim": self.ffn_dims}
        return {**config, **{key: value for key, value in required.items() if config.get(key) is None}, **width}

    gguf_architectures = ("lfm2",)
    gguf_names = LLAMA_GGUF_NAMES.extended(
        [
            ("token_embd_norm.", "norm."),
            ("blk.{i}.shortconv.conv.", "layers.{i}.attn.conv1d."),
            ("blk.{i}.shortconv.", "layers.{i}.attn."),
        ]
    )

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        config = hybrid_layers(llama_config(metadata, tensors, "lfm2"), "conv", "full_attention")
        return {
            **config,
            "conv_L_cache": m["shortconv.l_cache"],
            "norm_eps": config["rms_norm_eps"],
            "block_auto_adjust_ff_dim": False,  # the file's feed_forward_length is the adjusted width
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        """The convolutions (channels, kernel) as the model holds them, (channels, kernel, 1)."""
        weights = super().convert_gguf_weights(tensors, metadata)
        return {k: v[..., None] if k.endswith(".conv1d.weight") else v for k, v in weights.items()}
