"""`minimlx.load`: a model name -> (model, tokenizer), in the execution dtype that suits the device."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .errors import CheckpointError
from .io.checkpoint import load_model
from .io.gguf import load_gguf
from .io.resolve import resolve
from .text import Tokenizer


def default_dtype() -> str | None:
    """float32 on the CPU, where MLX's quantized and half-precision matmuls are far slower than BLAS
    float32 ones; on a GPU, None: weights stay as stored (GGUF quantized, folders in their dtype)."""
    return "float32" if mx.default_device() == mx.cpu else None


def load(path_or_name: str | Path, dtype: str | None = None) -> tuple[nn.Module, Tokenizer]:
    """Load a model and its tokenizer from a checkpoint folder, a `.gguf` file, a Hugging Face repo id
    (local cache first) or a short name such as `smollm2-135m`.

    `dtype`: None picks by device (see `default_dtype`); "float32", "float16" or "bfloat16" casts
    (dequantizing GGUF tensors); "quantized" keeps a GGUF file's quantized tensors as they are.
    """
    path = resolve(path_or_name)
    dtype = dtype or default_dtype()
    if path.is_dir():
        return load_model(path, dtype), Tokenizer.from_folder(path)
    if path.suffix.lower() != ".gguf":
        raise CheckpointError(f"{path} is neither a checkpoint folder nor a .gguf file; pass one of those")
    model, metadata = load_gguf(path, dtype)
    return model, Tokenizer.from_gguf(metadata)
