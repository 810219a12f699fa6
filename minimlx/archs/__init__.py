"""Architecture plugins. Importing this package registers the built-in ones."""

from . import deepseek_moe, gpt2, llama3, qwen3  # noqa: F401  (registration happens on import)
from .registry import build, build_model, get_arch, get_gguf_arch, list_archs, register, registrations

__all__ = ["build", "build_model", "get_arch", "get_gguf_arch", "list_archs", "register", "registrations"]
