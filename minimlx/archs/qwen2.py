"""Qwen2 / Qwen2.5 and Qwen2-MoE: LLaMA's block with biases on the query, key and value projections.

Qwen2-MoE routes like Qwen3-MoE (softmax router, top `num_experts_per_tok` of `num_experts`, renormalised
when `norm_topk_prob`) and adds one shared SwiGLU expert whose output each token scales by
sigmoid(shared_expert_gate(x)).

With `use_sliding_window`, a window of `sliding_window` tokens covers only some layers: those `layer_types` marks
`sliding_attention` (transformers 5), else as transformers derives them from `max_window_layers` (`windowed`); the
other layers attend over the whole text.
"""

from dataclasses import dataclass, replace

from .config import global_layers, number, sliding_window
from .decoder import DecoderConfig
from .gguf import Metadata, llama_config
from .llama3 import Llama3Config
from .names import LLAMA_GGUF_NAMES, LLAMA_NAMES
from .qwen3 import Qwen3MoeConfig, gguf_experts, qwen_experts
from .registry import register


@register("qwen2")
@dataclass
class Qwen2Config(DecoderConfig):
    example_config = {**Llama3Config.example_config, "model_type": "qwen2"}
    gguf_architectures = ("qwen2",)
    defaults = {"rms_norm_eps": 1e-6, "use_sliding_window": False}

    @classmethod
    def from_config(cls, config: dict):
        """q, k and v always have biases, the output projection never (there is no `attention_bias`)."""
        arch = replace(super().from_config(config), qkv_bias=True, out_bias=False)
        window = sliding_window({**cls.defaults, **config})
        if window is None:
            return arch
        if config.get("layer_types") is not None:
            full = global_layers(config, arch.layers, pattern=1)
        else:
            first = number(config, "max_window_layers", 28, low=0)
            full = tuple(i for i in range(arch.layers) if not cls.windowed(i, first))
        return replace(arch, window=window, global_layers=full)

    @staticmethod
    def windowed(layer: int, max_window_layers: int) -> bool:
        """transformers' rule: the layers from `max_window_layers` on slide the window."""
        return layer >= max_window_layers


@register("qwen2_moe")
@dataclass
class Qwen2MoeConfig(Qwen2Config):
    example_config = {
        **Qwen3MoeConfig.example_config,
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": 48,
    }
    gguf_architectures = ("qwen2moe",)
    names = LLAMA_NAMES.extended(
        [
            ("model.layers.{i}.mlp.shared_expert_gate.", "layers.{i}.ffn.shared_gate."),
            ("model.layers.{i}.mlp.shared_expert.", "layers.{i}.ffn.shared_experts."),
        ]
    )
    gguf_names = LLAMA_GGUF_NAMES.extended(
        [
            ("blk.{i}.ffn_gate_inp_shexp.", "layers.{i}.ffn.shared_gate."),
        ]
    )
    defaults = {**Qwen2Config.defaults, "rope_theta": 1000000.0}

    @staticmethod
    def windowed(layer: int, max_window_layers: int) -> bool:
        """transformers' Qwen2-MoE rule: every other layer below `max_window_layers`, from the first."""
        return layer % 2 == 0 and layer < max_window_layers

    @classmethod
    def from_config(cls, config: dict):
        arch = super().from_config(config)
        shared = number(config, "shared_expert_intermediate_size", 0, low=0)
        return replace(arch, moe=qwen_experts(config, shared))

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        m = Metadata(metadata)
        return {
            **llama_config(metadata, tensors, "qwen2_moe"),
            **gguf_experts(metadata),
            "shared_expert_intermediate_size": m.get("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": False,  # llama.cpp's qwen2moe graph never renormalises
        }

    def convert_gguf_weights(self, tensors: dict, metadata: dict) -> dict:
        return shared_gate_rows(super().convert_gguf_weights(tensors, metadata))


def shared_gate_rows(weights: dict) -> dict:
    """llama.cpp keeps the shared expert's gate as a vector; the model's is a (1, dims) linear map."""
    return {k: v.reshape(1, -1) if k.endswith("shared_gate.weight") else v for k, v in weights.items()}
