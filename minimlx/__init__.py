"""minimlx: run transformer language models with MLX and see what happens inside them."""

from .cpu import blas  # noqa: F401, I001  (first: the BLAS must be loaded before mlx.core)
from .archs import list_archs, register
from .loading import load, load_model
from .quantization import quantize
from .convert import convert
from .decode import Constraint, batch_generate, generate, load_prompt_cache, save_prompt_cache, stream_generate
from .anatomy import ledger, trace
from .explainer import explain
from .embedding import Embedder, embed

__version__ = "0.1.0"
__all__ = [
    "Constraint",
    "Embedder",
    "batch_generate",
    "convert",
    "embed",
    "explain",
    "generate",
    "ledger",
    "list_archs",
    "load",
    "load_model",
    "load_prompt_cache",
    "quantize",
    "register",
    "save_prompt_cache",
    "stream_generate",
    "trace",
]
