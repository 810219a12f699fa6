"""Loading a model: file -> plugin -> lazy model -> checked weights, packed or dequantized.

This is where io (files) and archs (plugins) meet: io reads config and tensors, the registry
names the plugin, the plugin renames and re-lays its tensors, and `quantization` decides how
packed weights run. Neither io nor archs imports the other.
"""

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .archs import build, gguf_config, plugin_config
from .archs.registry import get_mmproj_arch, reported
from .errors import CheckpointError, InvalidSettingError, ModelNotFoundError, UnsupportedArchitectureError
from .io.checkpoint import DTYPES, check_weights, install_weights, read_safetensors
from .io.config import read_config
from .io.gguf_file import GGUFFile, open_gguf, read_gguf
from .io.resolve import resolve
from .quantization import BLOCK_MODES, dequantize_weights, packed_modules, quantize_modules
from .text import Tokenizer

log = logging.getLogger("minimlx.loading")

DTYPE_CHOICES = ("quantized", *DTYPES)


def default_dtype() -> str | None:
    """On the CPU, float32 (MLX's quantized and half-precision CPU matmuls are far slower than BLAS float32 ones),
    unless the native kernel is installed: then None, which keeps the packed weights it reads packed and runs
    them through it (faster than float32 in a fraction of the memory: docs/performance.md) and dequantizes the
    rest to float32. On a GPU, None: weights stay as stored (quantized
    stays packed, floats in their dtype)."""
    if mx.default_device() != mx.cpu:
        return None
    from .cpu import native

    return None if native.kernel is not None else "float32"


@dataclass
class Checkpoint:
    """A checkpoint folder or GGUF file, read lazily: no tensor is read until it is evaluated."""

    arch: object  # the plugin config
    config: dict  # config.json's, or the one a GGUF file's metadata gives
    weights: dict[str, mx.array]  # under the model's names (packed triples where quantized)
    origin: dict[int, str] = field(default_factory=dict)  # checkpoint names by id(tensor), for error messages
    entry: dict | None = None  # config.json's quantization entry
    metadata: dict | None = None  # a GGUF file's metadata, its tokenizer included
    image_processor: dict | None = None  # the image processor's config where no folder holds it (an mmproj file's)


def read_checkpoint(
    path: Path, dtype: str | None = None, parallel: str | None = None, mmproj: str | Path | None = None
) -> Checkpoint:
    """The checkpoint at `path`: a folder (Hugging Face's or mlx-lm's: config.json + safetensors, quantized or not)
    or a GGUF file, whose tensor types MLX cannot run packed are re-packed into MLX affine quantization (see
    io/gguf_file.py), or dequantized into `dtype` when it is a float dtype. Only the returned weights refer to the
    tensors, so installing them one by one frees each as it goes. A folder's tensors are read when evaluated; a GGUF
    file's as they are converted, here: with `parallel`, only those of this rank's share (`rank_share`). A GGUF text
    file is read with llama.cpp's `mmproj` file of its vision tower: `mmproj`, or else the one `mmproj*.gguf` beside it
    that fits it (`mmproj_beside`)."""
    if mmproj is not None and path.suffix.lower() != ".gguf":
        raise InvalidSettingError(f"--mmproj goes with a .gguf text file; {path} holds its vision tower itself")
    if path.is_dir():
        config = read_config(path)
        plugin_config(config, str(path / "config.json"))  # a bad config is refused before any tensor is read
        raw = read_safetensors(path)
        config, raw = as_language_model(config, raw)
        arch = plugin_config(config, str(path / "config.json"))
        entry = config.get("quantization") or config.get("quantization_config")
        return Checkpoint(arch, config, arch.convert_weights(raw), {id(w): name for name, w in raw.items()}, entry)
    if path.suffix.lower() != ".gguf":
        raise CheckpointError(f"{path} is neither a checkpoint folder nor a .gguf file; pass one of those")
    if parallel is not None:
        if mmproj is not None:
            raise InvalidSettingError("an mmproj file is not read across processes yet; drop --parallel or --mmproj")
        return rank_share(path, dtype, parallel)
    tensors, metadata = read_gguf(path, DTYPES.get(dtype), stored=stored_blocks(dtype))
    mmproj = Path(mmproj) if mmproj is not None else mmproj_beside(path, metadata)
    if mmproj is None:
        return gguf_checkpoint(path, metadata, tensors, tensors)
    return image_text_checkpoint(path, metadata, tensors, mmproj, dtype)


def stored_blocks(dtype: str | None) -> frozenset:
    """The GGUF block types whose matrices are read as the file stores them: on the CPU, where packed weights stay
    packed, those the native kernel multiplies as they are (`cpu.linear.BLOCK_FORMS`); none elsewhere (a GPU's
    kernels read MLX's layouts)."""
    if mx.default_device() != mx.cpu or dtype not in (None, "quantized"):
        return frozenset()
    from .cpu.linear import stored_block_types

    return stored_block_types()


def as_language_model(config: dict, raw: dict[str, mx.array]) -> tuple[dict, dict[str, mx.array]]:
    """A base model's checkpoint (`Qwen3Model`, as embedding models such as Qwen3-Embedding are saved: the stack
    without the language-model head, its tensors without the `model.` prefix) read as its language model: the
    prefix added, and the head tied to the embedding (whose scores mean nothing there: such a model is for its
    hidden states, `minimlx.Embedder`)."""
    architectures = config.get("architectures") or []
    base = any(name.endswith("Model") and not name.endswith("LMHeadModel") for name in architectures)
    stack = any(k.startswith(("embed_tokens.", "layers.")) for k in raw)  # a decoder's stack, unprefixed
    if not (base and stack) or any(k.startswith("model.") for k in raw):
        return config, raw
    raw = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in raw.items()}
    if not any(k.startswith("lm_head.") for k in raw):
        config = {**config, "tie_word_embeddings": True}
    return config, raw


def gguf_checkpoint(path: Path, metadata: dict, tensors, weights: dict[str, mx.array]) -> Checkpoint:
    """A GGUF file's checkpoint: the config from its metadata and `tensors` (which `gguf_config` looks up: file
    names), the plugin's weights from `weights` (file names)."""
    config = gguf_config(metadata, tensors, str(path))
    arch = plugin_config(config, str(path))
    return Checkpoint(arch, config, arch.convert_gguf_weights(weights, metadata), metadata=metadata)


def image_text_checkpoint(path: Path, metadata: dict, tensors: dict, mmproj: Path, dtype: str | None) -> Checkpoint:
    """A GGUF text file (its `metadata` and `tensors`) and llama.cpp's mmproj file of its vision tower as one image-text
    checkpoint: the plugin reading the mmproj's projector type (`mmproj_projectors`) makes the config of both (from the
    two files' metadata and the mmproj's tensors' shapes), names the tower's tensors (read as floats) and gives the
    image processor's settings."""
    if not mmproj.is_file():
        raise ModelNotFoundError(f"no such mmproj file: {mmproj}; give the vision tower's .gguf file (mmproj-*.gguf)")
    directory = open_gguf(mmproj)
    clip, shapes = directory.metadata, {name: shape for name, (_, shape, _) in directory.tensors.items()}
    reader = mmproj_reader(clip, str(mmproj))
    if metadata.get("general.architecture") not in reader.mmproj_text:
        raise CheckpointError(
            f"{mmproj} is a {clip.get('clip.projector_type')} vision tower, for {' or '.join(reader.mmproj_text)} "
            f"text files, not {metadata.get('general.architecture')}; give the mmproj file of this model"
        )
    text = gguf_config(metadata, tensors, str(path))
    width, projected = text.get("hidden_size"), clip.get("clip.vision.projection_dim")
    if projected is not None and projected != width:
        raise CheckpointError(
            f"{mmproj} projects images to width {projected} but {path.name}'s model is {width} wide: it belongs to "
            "another model; give this model's mmproj file"
        )
    with reported(reader, str(mmproj), "the plugin for its projector"):
        config = reader.mmproj_config(text, metadata, clip, shapes)
        processor = reader.mmproj_processor(clip)
    arch = plugin_config(config, f"{path} with {mmproj.name}")
    vision, _ = read_gguf(mmproj, DTYPES.get(dtype) or mx.float32)
    weights = {**arch.convert_gguf_weights(tensors, metadata), **arch.convert_mmproj_weights(vision)}
    return Checkpoint(arch, config, weights, metadata=metadata, image_processor=processor)


def mmproj_reader(clip: dict, source: str) -> type:
    """The plugin that reads an mmproj file of metadata `clip`; one line when the file is no mmproj file."""
    if clip.get("general.architecture") != "clip" or not clip.get("clip.has_vision_encoder"):
        raise CheckpointError(f"{source} is not an mmproj file (llama.cpp's converter writes one with --mmproj)")
    return get_mmproj_arch(clip.get("clip.projector_type"))


def mmproj_beside(path: Path, metadata: dict) -> Path | None:
    """The `mmproj*.gguf` file beside the text file `path` that fits it (a vision tower for its architecture and
    width), as llama.cpp's tools find one; None when none fits; one line when several do (name one with --mmproj)."""
    fits = []
    for candidate in sorted(path.parent.glob("mmproj*.gguf")):
        try:
            clip = open_gguf(candidate).metadata
            reader = mmproj_reader(clip, str(candidate))
        except (CheckpointError, UnsupportedArchitectureError):
            continue
        width = metadata.get(f"{metadata.get('general.architecture')}.embedding_length")
        if metadata.get("general.architecture") in reader.mmproj_text and clip.get("clip.vision.projection_dim") in (
            None,
            width,
        ):
            fits.append(candidate)
    if len(fits) > 1:
        names = ", ".join(f.name for f in fits)
        raise InvalidSettingError(f"several mmproj files beside {path.name} fit it ({names}); name one with --mmproj")
    return fits[0] if fits else None


class OnLookup(Mapping):
    """A GGUF file's tensors (file names, as `read_gguf` gives them), each read when it is looked up (not when asked
    whether it is there)."""

    def __init__(self, path: Path, file: GGUFFile, dtype: mx.Dtype | None):
        self.path, self.dtype = path, dtype
        self.tensor_of = file_tensors(file, dtype)

    def __getitem__(self, part: str) -> mx.array:
        return read_gguf(self.path, self.dtype, [self.tensor_of[part]])[0][part]

    def __contains__(self, part) -> bool:
        return part in self.tensor_of

    def __iter__(self):
        return iter(self.tensor_of)

    def __len__(self) -> int:
        return len(self.tensor_of)


def file_tensors(file: GGUFFile, dtype: mx.Dtype | None) -> dict[str, str]:
    """The file tensor each array `read_gguf` gives comes from (names -> file names)."""
    return {part: name for name in file.tensors for part in file.layout(name, dtype)}


def gguf_standins(path: Path, dtype: mx.Dtype | None) -> tuple[GGUFFile, dict[str, mx.array], Checkpoint]:
    """A GGUF file's checkpoint on stand-ins for its tensors: lazy zeros of the shape and dtype `read_gguf` gives
    each (file names), never computed; the config reads the few tensors it needs from the file. Returns the file,
    the stand-ins and the checkpoint."""
    file = open_gguf(path)
    standins = {
        part: mx.zeros(shape, kind) for name in file.tensors for part, (shape, kind) in file.layout(name, dtype).items()
    }
    return file, standins, gguf_checkpoint(path, file.metadata, OnLookup(path, file, dtype), dict(standins))


def with_tensors(checkpoint: Checkpoint, tensors: dict[str, mx.array]) -> Checkpoint:
    """A GGUF file's `checkpoint` (its config as it is) holding the plugin's weights of `tensors` (file names)."""
    return replace(checkpoint, weights=checkpoint.arch.convert_gguf_weights(tensors, checkpoint.metadata))


def rank_share(path: Path, dtype: str | None, parallel: str) -> Checkpoint:
    """A GGUF file's checkpoint with only the tensors of this rank's share of `parallel` read.

    The model is first cut on stand-ins (`gguf_standins`): a file tensor is read when its own conversion gives a
    tensor this rank keeps (or one the cut does not know). The checkpoint holds the stand-ins of the others, which
    the same cut drops again before anything is computed."""
    dequantized = DTYPES.get(dtype)
    file, standins, plan = gguf_standins(path, dequantized)
    planned, split = set(plan.weights), splitter(parallel)
    prepare(plan, dtype, split)
    kept, arch = set(split.tensors), plan.arch
    needed = []
    for name in file.tensors:
        parts = file.layout(name, dequantized)
        gives = set(arch.convert_gguf_weights({part: standins[part] for part in parts}, file.metadata))
        if not gives or gives & kept or not gives <= planned:
            needed.append(name)
    return with_tensors(plan, {**standins, **read_gguf(path, dequantized, needed)[0]})


def check_dtype(dtype: str | None) -> None:
    if dtype not in (None, *DTYPE_CHOICES):
        raise InvalidSettingError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")


def splitter(parallel: str | None):
    """How this process cuts the model it loads: "pipeline" or "tensor" across the ranks `mlx.launch` started
    (see minimlx.distributed), or None to hold it whole."""
    if parallel is None:
        return None
    from .distributed import split_for

    return split_for(parallel)


def assemble(checkpoint: Checkpoint, dtype: str | None, parallel: str | None = None) -> nn.Module:
    """The model of `checkpoint`'s plugin config, holding its weights (model names; packed triples where quantized).

    `dtype` None or "quantized" keeps packed weights packed and floats as stored, except on the CPU, where
    floats run in float32 (MLX's CPU kernels are far slower in half precision, and its gathered expert matmuls
    take float32 inputs only) but packed modules' float16 scales and biases stay so (`float16_scales`); there, the
    packed modules the native kernel runs (when it is
    installed) run through it, and with None (the CPU default when the kernel is installed) the other packed
    modules are dequantized to float32 instead of running on MLX's packed CPU kernels. A float dtype
    dequantizes every packed weight into it. The config's quantization entry is checked against the packed shapes.
    The checkpoint's `weights` are emptied as tensors are installed, so that no second copy of the model stays
    referenced. With `parallel`, the checked model and its unread tensors are cut to this rank's share first: only
    those are read.
    """
    check_dtype(dtype)
    split = splitter(parallel)
    model, weights, execution = prepare(checkpoint, dtype, split)
    on_cpu = mx.default_device() == mx.cpu
    install_weights(model, weights, execution, float16_scales(model, weights) if on_cpu else set())
    if on_cpu:
        from .cpu.forms import use_cpu_forms

        use_cpu_forms(model)
    return model if split is None else split.join(model)


def prepare(checkpoint: Checkpoint, dtype: str | None, split) -> tuple[nn.Module, dict[str, mx.array], mx.Dtype | None]:
    """`assemble` up to installing: the model with its quantized forms in, the checked (unread) weights it takes,
    cut by `split` when given, and the dtype floats run in."""
    weights = checkpoint.weights
    model = build(checkpoint.arch)
    if "vision" in model and not any(name.startswith("vision.") for name in weights):
        log.warning("the checkpoint holds no vision tower (a text-only conversion): its text model is read")
        model.pop("vision")
    spec = packed_modules(model, weights, checkpoint.entry)
    on_cpu = mx.default_device() == mx.cpu
    if dtype in (None, "quantized"):
        on_kernel = {}
        if on_cpu:
            from .cpu.linear import packed_on_kernel, quantize_on_kernel

            on_kernel = packed_on_kernel(model, spec)
            quantize_on_kernel(model, on_kernel)
        rest = {path: q for path, q in spec.items() if path not in on_kernel}
        blocks = {path: q for path, q in rest.items() if q["mode"] in BLOCK_MODES}  # MLX has no kernel for them
        if on_cpu and dtype is None:
            dequantize_weights(weights, rest)
        else:
            dequantize_weights(weights, blocks)
            quantize_modules(model, {path: q for path, q in rest.items() if path not in blocks})
        execution = mx.float32 if on_cpu else None
    else:
        dequantize_weights(weights, spec)
        execution = DTYPES[dtype]
    check_weights(model, weights, checkpoint.origin)
    if split is not None:
        model, weights = split.shard(model, weights, execution)
    return model, weights, execution


def float16_scales(model: nn.Module, weights: dict[str, mx.array]) -> set[str]:
    """The float16 scales and biases of `weights` that stay float16 on the CPU, where other floats run in float32:
    every packed module's products widen them as they read them (the native kernel's and MLX's quantized matmuls,
    float32 in and out), so float32 copies would only cost memory (6 bits a weight instead of 5 for 4-bit groups
    of 32). Not those of MLX's own quantized embedding, whose rows come out in their scales' dtype."""
    return {
        name
        for path, module in model.named_modules()
        if "scales" in module and type(module) is not nn.QuantizedEmbedding
        for name in (f"{path}.scales", f"{path}.biases")
        if name in weights and weights[name].dtype == mx.float16
    }


def load_model(path: str | Path, dtype: str | None = None, parallel: str | None = None) -> nn.Module:
    """A checkpoint folder (Hugging Face's or mlx-lm's: config.json + safetensors, quantized or not) as a model
    (this rank's part of it with `parallel`, see `assemble`)."""
    folder = Path(path)
    if not folder.exists():
        raise ModelNotFoundError(f"no such model folder: {folder}")
    return assemble(read_checkpoint(folder), dtype, parallel)


def load(
    path_or_name: str | Path,
    dtype: str | None = None,
    parallel: str | None = None,
    adapter: str | Path | None = None,
    mmproj: str | Path | None = None,
) -> tuple[nn.Module, Tokenizer]:
    """Load a model and its tokenizer from a checkpoint folder, a `.gguf` file, a Hugging Face repo id
    (local cache first) or a short name such as `smollm2-135m`.

    `dtype`: None picks by device (see `default_dtype`); "float32", "float16" or "bfloat16" casts
    (dequantizing packed weights); "quantized" keeps packed weights packed. `parallel`: "pipeline" or
    "tensor" loads this rank's part of the model, in a process `mlx.launch` started (minimlx.distributed).
    `adapter`: a LoRA or DoRA adapter folder (PEFT's or mlx-lm's) applied to the model (`minimlx.tune.load_adapter`).
    `mmproj`: with a .gguf text file, llama.cpp's mmproj file of its vision tower (default: the one `mmproj*.gguf`
    beside it that fits it, if any), as llama.cpp's `--mmproj FILE`.
    """
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise InvalidSettingError(f"load takes a folder, a .gguf file or a model name, not {path_or_name!r}")
    path = resolve(path_or_name)
    dtype = dtype or default_dtype()
    check_dtype(dtype)
    checkpoint = read_checkpoint(path, dtype, parallel, mmproj)
    model = assemble(checkpoint, dtype, parallel)
    tokenizer = Tokenizer.from_folder(path) if checkpoint.metadata is None else Tokenizer.from_gguf(checkpoint.metadata)
    if "vision" in model:
        from .vision import read_processor_config

        settings = checkpoint.image_processor
        model.image_processor = model.config.image_processor(settings or read_processor_config(path))
        model.config = model.config.with_tokenizer(tokenizer)
    vocabulary = getattr(model.config, "vocab_size", None)
    if vocabulary is not None and tokenizer.vocab_size > vocabulary:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} token ids but the model's embedding holds {vocabulary}; "
            "the tokenizer belongs to another model, put the right one beside the weights"
        )
    if adapter is not None:
        from .tune.formats import load_adapter

        load_adapter(model, adapter)
        model.eval()
    return model, tokenizer
