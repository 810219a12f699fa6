"""Architecture plugins. Importing this package registers the built-in ones."""

from . import deepseek_moe, gpt2, llama3, qwen3  # noqa: F401  (registration happens on import)
from .registry import get_arch, list_archs, register, registrations

__all__ = ["get_arch", "list_archs", "register", "registrations"]
