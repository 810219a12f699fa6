"""`minimlx fuse`: a base model with an adapter folded into its weights, written as an MLX folder, a Hugging Face
folder or a GGUF file.

The base is loaded as stored (packed weights stay packed), the adapter attached, and each adapted linear map's
weight replaced by its fused one (`fused_weight`: W + scale B A, DoRA's magnitude applied). Then:

- an MLX folder (mlx-lm's names and `quantization` entry, as `minimlx convert` writes): a map whose base was packed
  is packed again with its base's settings (group size, bits, mode); every other tensor is written as the base has it;
- a Hugging Face folder: every weight in float (packed ones unpacked), under the names and layouts transformers reads
  (the plugin's `export_hf_weights`: gpt-oss's experts fused and interleaved again), without a quantization entry;
- a GGUF file: that Hugging Face folder converted by llama.cpp's own `convert_hf_to_gguf.py` (a llama.cpp checkout
  named by `llama_cpp` or `$MINIMLX_LLAMACPP`), so that every family its converter knows is written as llama.cpp,
  Ollama and LM Studio read it.

Floats are written in `dtype`, by default the base checkpoint's own float dtype.
"""

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..convert import (
    check_target,
    dominant_float_dtype,
    export,
    kept_entry,
    mlx_lm_entry,
    one_by_one,
    quantized_modules,
    read_source,
    write_config,
    write_readme,
    write_shards,
    write_whole,
)
from ..core.quantized import QuantizedWeight
from ..errors import InvalidSettingError, UnsupportedArchitectureError
from ..io.checkpoint import DTYPES
from ..io.resolve import resolve
from ..loading import load_model
from ..quantization import dequantize_weights
from .formats import load_adapter
from .lora import adapters, base_weight, expert_adapters

FORMATS = ("mlx", "hf", "gguf")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
CONVERTER = "convert_hf_to_gguf.py"


def fuse(
    model: str | Path,
    adapter_path: str | Path,
    save_path: str | Path,
    format: str | None = None,
    dtype: str | None = None,
    gguf_type: str | None = None,
    llama_cpp: str | Path | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Fold the adapter at `adapter_path` into `model` and write the result to `save_path`: an MLX folder (`format`
    "mlx", the default), a Hugging Face folder ("hf") or a GGUF file ("gguf", the default when `save_path` ends in
    .gguf; `gguf_type` one of f32, f16, bf16, q8_0, by default f16, or f32 for a float32 base). Returns `save_path`."""
    out = Path(save_path).expanduser()
    format = format or ("gguf" if out.suffix.lower() == ".gguf" else "mlx")
    if format not in FORMATS:
        raise InvalidSettingError(f"unknown fuse format {format!r}; use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise InvalidSettingError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if gguf_type is not None and gguf_type not in GGUF_TYPES:
        raise InvalidSettingError(f"unknown GGUF type {gguf_type!r}; use one of {', '.join(GGUF_TYPES)}")
    converter = gguf_converter(llama_cpp) if format == "gguf" else None
    if format == "gguf":
        if out.exists() and not force:
            raise InvalidSettingError(f"{out} already exists; name a new file, or pass --force to replace it")
    else:
        check_target(out, force)
    say = progress or (lambda line: None)
    path = resolve(model)
    source, _, write_tokenizer = read_source(path, None)
    dtype = dtype or dominant_float_dtype(source.weights)
    config = source.config
    del source
    fused = load_model(path, "quantized")
    load_adapter(fused, adapter_path)
    folded = fold(fused)
    say(f"{path.name} + {Path(adapter_path).name}: {len(folded)} maps fused -> {out} ({format})")
    arch = fused.config
    tensors = dict(tree_flatten(fused.parameters()))
    if format == "mlx":
        packed = quantized_modules(fused)
        tensors = export(arch, cast_floats(tensors, dtype))
        entry = mlx_lm_entry(arch, packed, kept_entry(packed, config.get("quantization"))) if packed else None
        write_folder(out, tensors, config, entry, dtype, write_tokenizer, path, say)
    else:
        tensors = hf_export(arch, cast_floats(dequantize_weights(tensors, quantized_modules(fused)), dtype))
        if format == "hf":
            write_folder(out, tensors, config, None, dtype, write_tokenizer, path, say)
        else:
            kind = gguf_type or ("f32" if dtype == "float32" else "f16")
            with tempfile.TemporaryDirectory(dir=out.parent) as folder:
                hf = Path(folder) / "hf"
                write_folder(hf, tensors, config, None, dtype, write_tokenizer, path, say)
                convert_to_gguf(converter, hf, kind, out)
    say(f"wrote {out}")
    return out


def fold(model: nn.Module) -> list[str]:
    """Each adapter form of `model` replaced by its base map (adapted experts by their base experts) holding the
    fused weights: packed again with the base's settings where the base was packed, else in the base's dtype.
    Returns the module paths folded."""
    folded = []
    for path, form in adapters(model).items():
        hold(form.base, form.fused_weight())
        folded.append((path, form.base))
    for path, form in expert_adapters(model).items():
        for name, weight in form.fused_weights().items():
            hold(form.base[name], weight)
        folded.append((path, form.base))
    model.update_modules(tree_unflatten(folded))
    return [path for path, _ in folded]


def hold(base: nn.Module, weight: mx.array) -> None:
    """`base` (a linear map or stacked expert projection) made to hold the float `weight`: packed with its own
    settings where it is packed."""
    if isinstance(base, (nn.QuantizedLinear, QuantizedWeight)):
        scales = base.scales.dtype if mx.issubdtype(base.scales.dtype, mx.floating) else mx.float32
        packed = mx.quantize(weight.astype(scales), base.group_size, base.bits, mode=base.mode)
        base.update(dict(zip(("weight", "scales", "biases"), packed)))
    else:
        base.weight = weight.astype(base_weight(base).dtype)
    mx.eval(base.parameters())


def hf_export(arch, tensors: dict) -> dict:
    """The model's float tensors under transformers' names and layouts (the plugin's `export_hf_weights`)."""
    if not hasattr(arch, "export_hf_weights"):
        raise UnsupportedArchitectureError(
            f"the {type(arch).__name__} plugin has no export_hf_weights (its Hugging Face tensor layout), so minimlx "
            "fuse cannot write it as a Hugging Face folder or GGUF file; fuse to an MLX folder"
        )
    return arch.export_hf_weights(tensors)


def cast_floats(tensors: dict, dtype: str) -> dict:
    """Float tensors in `dtype`; packed words and their uint8 scales as they are (a packed map's float scales too)."""
    target = DTYPES[dtype]
    packed = {name.rpartition(".")[0] for name in tensors if name.endswith(".scales")}
    return {
        name: w.astype(target)
        if mx.issubdtype(w.dtype, mx.floating) and name.rpartition(".")[0] not in packed and w.dtype != target
        else w
        for name, w in tensors.items()
    }


def write_folder(out: Path, tensors: dict, config: dict, entry, dtype: str, write_tokenizer, source: Path, say) -> None:
    """`tensors` (checkpoint names) as a folder, with the base's config (`entry` its quantization, or none), its
    tokenizer and a README."""
    layout = {name: (w.shape, w.dtype) for name, w in tensors.items()}
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}

    def write(folder: Path) -> None:
        write_shards(layout, one_by_one(dict(tensors)), folder, 5 << 30, say)
        write_config(config, entry, dtype, folder / "config.json")
        write_tokenizer(folder)
        write_readme(folder, source, config.get("model_type"), entry, dtype)

    write_whole(out, sum(w.nbytes for w in tensors.values()), write)


def gguf_converter(llama_cpp: str | Path | None) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` in the checkout `llama_cpp` (or `$MINIMLX_LLAMACPP`)."""
    folder = llama_cpp or os.environ.get("MINIMLX_LLAMACPP")
    if folder is None:
        raise InvalidSettingError(
            "GGUF files are written by llama.cpp's own converter; pass --llama-cpp DIR (a llama.cpp checkout) or set "
            "MINIMLX_LLAMACPP, or fuse to an MLX or Hugging Face folder"
        )
    converter = Path(folder).expanduser() / CONVERTER
    if not converter.is_file():
        raise InvalidSettingError(f"{folder} has no {CONVERTER}; name a llama.cpp checkout")
    return converter


def convert_to_gguf(converter: Path, folder: Path, kind: str, out: Path) -> None:
    """llama.cpp's converter on the Hugging Face `folder`, in a process of its own (with its own gguf-py)."""
    gguf_py = converter.parent / "gguf-py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(gguf_py), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, str(converter), str(folder), "--outtype", kind, "--outfile", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InvalidSettingError(f"llama.cpp's {CONVERTER} could not convert the fused model: {last}")
