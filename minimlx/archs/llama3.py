"""LLaMA 3 (and every checkpoint with `model_type: llama`): the plain decoder block, as `DecoderConfig` builds it.

Blocks: RMSNorm -> grouped-query attention with RoPE (plain, linear or llama3 scaling) -> RMSNorm -> SwiGLU FFN.
Head tied to the embedding or separate. llama.cpp's `llama` files hold LLaMA, Mistral and (with experts) Mixtral.
"""

from dataclasses import dataclass

from ..errors import UnsupportedArchitectureError
from .decoder import DecoderConfig
from .gguf import Metadata, llama_config
from .registry import register


@register("llama")
@dataclass
class Llama3Config(DecoderConfig):
    # A tiny model of this family in config.json form; `minimlx archs` builds it (lazily) to list the parts.
    example_config = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    gguf_architectures = ("llama",)
    gguf_rows_permuted = True

    @classmethod
    def gguf_config(cls, metadata: dict, tensors: dict) -> dict:
        """llama.cpp's `llama` files: LLaMA, Mistral, and (with experts) Mixtral."""
        m = Metadata(metadata)
        config = llama_config(metadata, tensors, "llama")
        if m.get("expert_count"):
            config.update(num_local_experts=m["expert_count"], num_experts_per_tok=m["expert_used_count"])
            config["model_type"] = "mixtral"
        if m.get("rope.dimension_count", config["head_dim"]) != config["head_dim"]:
            raise UnsupportedArchitectureError("GGUF files with partial rotary embeddings are not supported yet")
        return config
