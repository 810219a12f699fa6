"""Architecture plugins. Importing this package registers the built-in ones."""

from . import (  # noqa: F401  (registration happens on import)
    deepseek,
    deepseek_moe,
    gemma,
    gemma4,
    glm4,
    gpt2,
    gpt_oss,
    granite_hybrid,
    idefics3,
    lfm2,
    llama3,
    llama4,
    minimax,
    mistral,
    olmo3,
    phi3,
    qwen2,
    qwen2_vl,
    qwen3,
    qwen3_next,
    qwen3_vl,
    smollm3,
)
from .registry import (
    build,
    build_model,
    get_arch,
    get_gguf_arch,
    gguf_config,
    list_archs,
    plugin_config,
    register,
    registrations,
)

__all__ = [
    "build",
    "build_model",
    "get_arch",
    "get_gguf_arch",
    "gguf_config",
    "list_archs",
    "plugin_config",
    "register",
    "registrations",
]
