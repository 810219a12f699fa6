"""minimlx: run transformer language models with MLX and see what happens inside them."""

from .archs import list_archs, register
from .io.checkpoint import load_model

__version__ = "0.1.0"
__all__ = ["list_archs", "load_model", "register"]
