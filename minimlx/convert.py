"""Converting a checkpoint (Hugging Face folder, MLX folder, GGUF file) into an MLX folder, quantized or not.

The folder written is the one mlx-lm writes and reads: config.json with the `quantization` entry, safetensors
shards under mlx-lm's tensor names (each plugin's `export_weights`), the tokenizer files and a short README.md.

Nothing is read up front: the source's tensors (`mx.load`), their renaming, dequantization, casting and
quantization (`mx.quantize` makes graph nodes too) stay one lazy graph. Each shard's header is written first
(shapes and dtypes are known without evaluating anything), then each tensor is evaluated, written and dropped,
so that peak memory is near the largest output tensor plus the source tensors it is computed from, not the
model. A GGUF file's tensors are read into memory as they are unpacked, not lazily: the conversion is first run
on stand-ins for them, whose graphs say which file tensors each output reads, and then again for a few output
tensors at a time on just the file tensors those read (`computed_from_gguf`).

Which weights are written how:
- quantizing (`quantize`, or any of `bits`, `group_size`, `recipe`, a `mode` other than affine): packed source
  weights are dequantized, every float weight is cast to `dtype` when given, then `minimlx.quantize` packs every
  linear map, embedding and stack of experts whose input width is a multiple of the group size.
  Without a `group_size`, affine re-quantization of packed weights keeps their group size (32 for any GGUF):
  rounding weights onto 4-bit groups of 32 and then onto groups of 64 loses far more than once (SmolLM2-135M's
  Q4_1 file re-quantized in groups of 64 no longer answers "Paris"; in groups of 32 it does).
  Expert routers stay in float: they are tiny, their precision decides which experts run, and mlx-lm reads
  DeepSeek's router only in float.
- `dtype` alone: packed weights are dequantized into it, and every float tensor is cast to it.
- neither: tensors are written as they are, packed ones included (an MLX folder keeps its quantization; a
  GGUF's Q4_0, Q4_1, Q8_0, Q4_K and Q5_K tensors are MLX affine quantization with groups of 32, and stay so).
Without `dtype`, a dequantized weight takes the dtype of its scales, and other floats keep theirs.
"""

import ctypes
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .archs import build
from .archs.config import normalize_config
from .core import Router
from .core.rope import llama3_inv_freq
from .errors import CheckpointError, InvalidSettingError, UnsupportedArchitectureError
from .io.checkpoint import DTYPES, check_weights
from .io.gguf_file import open_gguf
from .io.resolve import resolve
from .loading import Checkpoint, file_tensors, gguf_standins, read_checkpoint, with_tensors
from .quantization import MODES, dequantize_weights, packed_modules, quantize_modules
from .quantization import quantize as quantize_model
from .text.gguf_vocab import read_vocab
from .text.tokenizer import add_special_tokens

SHARD_SIZE = 5 << 30  # bytes: mlx-lm's (and the Hugging Face Hub's) largest file
SIDE_FILES = (  # what a model needs beside its weights and config: tokenizer, chat template, processors
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def convert(
    source: str | Path,
    out: str | Path,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str = "affine",
    recipe: str | None = None,
    dtype: str | None = None,
    *,
    force: bool = False,
    shard_size: int = SHARD_SIZE,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write `source` (a checkpoint folder, a .gguf file, a Hugging Face repo id or a short name) as an MLX
    folder `out` that minimlx and mlx-lm load; returns `out`.

    `quantize` packs the weights (`bits`, `group_size`, `mode`, `recipe` as in `minimlx.quantize`; giving any of
    them quantizes too); `dtype` ("float32", "float16", "bfloat16") casts the float tensors. Shards hold at most
    `shard_size` bytes (a tensor larger than that gets a shard of its own). `progress` receives one line per
    shard written. `out` must not exist or be an empty folder; `force` replaces a folder that holds files.

    The folder is written whole or not at all: into a hidden folder beside `out`, renamed to `out` once every
    file is written, so that an interrupted, killed or failed conversion leaves `out` as it was.
    """
    quantize = quantize or any(v is not None for v in (bits, group_size, recipe)) or mode != "affine"
    recipe = recipe.replace("_", "-") if isinstance(recipe, str) else recipe  # mlx-lm spells them mixed_3_6
    if dtype is not None and dtype not in DTYPES:
        raise InvalidSettingError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if quantize:
        check_quantization(bits, group_size, mode, recipe)
    out = Path(out).expanduser()
    check_target(out, force)
    say = progress or (lambda line: None)

    path = resolve(source)
    checkpoint, standins, tokenizer = read_source(path, dtype)
    config = checkpoint.arch.export_config(checkpoint.config)  # first: a family mlx-lm cannot read is refused here
    spec = packed_modules(build(checkpoint.arch), checkpoint.weights, checkpoint.entry)
    if quantize and group_size is None and mode == "affine" and spec:
        # re-quantize on the groups the weights were packed in: a second rounding on other groups compounds the first
        group_size = Counter(q["group_size"] for q in spec.values()).most_common(1)[0][0]
    doing = plan(quantize, bits, group_size, mode, recipe, dtype, spec)
    say(f"{path.name} ({checkpoint.config.get('model_type')}) -> {out}: {doing}")
    outputs = partial(
        output_tensors, quantize=quantize, bits=bits, group_size=group_size, mode=mode, recipe=recipe, dtype=dtype
    )
    tensors, quantization = outputs(checkpoint)
    torch_dtype = dtype or dominant_float_dtype(tensors)
    layout = {name: (w.shape, w.dtype) for name, w in tensors.items()}
    if standins is None:  # a folder's tensors are read as they are evaluated
        arrays = one_by_one(tensors)
    else:
        arrays = computed_from_gguf(path, dtype, checkpoint, standins, tensors, outputs)
    del checkpoint, standins, tensors  # from here on only `arrays` refers to the (lazy) weights

    def write(folder: Path) -> None:
        write_shards(layout, arrays, folder, shard_size, say)
        write_config(config, quantization, torch_dtype, folder / "config.json")
        tokenizer(folder)
        write_readme(folder, path, config.get("model_type"), quantization, torch_dtype)

    write_whole(out, sum(math.prod(shape) * kind.size for shape, kind in layout.values()), write)
    say(f"wrote {out}")
    return out


def check_target(out: Path, force: bool) -> None:
    """Refuse an `out` that is a file, or a folder that holds files unless `force`: before any work."""
    if out.exists() and not out.is_dir():
        raise InvalidSettingError(f"{out} already exists and is not a folder; name a new folder to write to")
    if out.exists() and any(out.iterdir()) and not force:
        raise InvalidSettingError(
            f"{out} already exists and is not an empty folder; name a new folder to write to, or pass --force to "
            "replace it"
        )


def write_whole(out: Path, size: int, write: Callable[[Path], None]) -> None:
    """`write` a folder into a hidden one beside `out`, renamed to `out` once it returns, so that an interrupted,
    killed or failed conversion leaves `out` as it was; `size` bytes must fit on the disk before it starts."""
    out.parent.mkdir(parents=True, exist_ok=True)
    check_room(out, size)
    staging = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except OSError as e:  # a full disk, say
        reason = " ".join(str(e).split())
        raise InvalidSettingError(f"writing {out} failed ({reason}); {out} is as it was") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def output_tensors(checkpoint: Checkpoint, quantize, bits, group_size, mode, recipe, dtype) -> tuple[dict, dict | None]:
    """The folder's tensors (mlx-lm's names, lazy) computed from the checkpoint's weights, which it empties, and
    mlx-lm's `quantization` entry for them (None when nothing is packed)."""
    arch, weights, entry = checkpoint.arch, checkpoint.weights, checkpoint.entry
    model = build(arch)
    spec = packed_modules(model, weights, entry)
    if quantize or dtype is not None:
        weights = float_weights(weights, spec, dtype)
        check_weights(model, weights, checkpoint.origin)
        model.update(tree_unflatten(list(weights.items())))
        if quantize:
            entry = quantize_floats(model, bits, group_size, mode, recipe)
    else:
        quantize_modules(model, spec)
        check_weights(model, weights, checkpoint.origin)
        model.update(tree_unflatten(list(weights.items())))
        if spec:
            entry = kept_entry(spec, entry)
    weights.clear()
    packed = quantized_modules(model)
    tensors = export(arch, dict(tree_flatten(model.parameters())))
    return tensors, mlx_lm_entry(arch, packed, entry) if packed else None


def computed_from_gguf(
    path: Path, dtype: str | None, checkpoint: Checkpoint, standins: dict, tensors: dict, outputs: Callable
) -> Iterator[tuple[str, mx.array]]:
    """The folder's tensors, in `tensors`' order, computed a few at a time from the GGUF file's tensors they read.

    `tensors` are `outputs` of the checkpoint on stand-ins (`gguf_standins`); their graphs say which file tensors
    each one reads. For each group of them (`grouped`) its file tensors are read, the conversion is run again on them
    (stand-ins for the rest, which the group's tensors never read), and the group's tensors are handed out one by
    one, each freed (with the sources nothing else reads) once written.
    """
    file, dequantized = open_gguf(path), DTYPES.get(dtype)
    groups = grouped(tensors, sources(tensors, standins), standins)
    tensors.clear()
    file_tensor = file_tensors(file, dequantized)
    for names, parts in groups:
        read = {}
        for name in sorted({file_tensor[part] for part in parts}):
            read.update(file.read(name, dequantized))
        computed, _ = outputs(with_tensors(checkpoint, {**standins, **read}))
        del read
        group = {name: computed.pop(name) for name in names}
        del computed
        yield from one_by_one(group)


def grouped(tensors: dict, reads: dict[str, set[str]], inputs: dict) -> list[tuple[list[str], set[str]]]:
    """Consecutive `tensors` in groups, each with the `inputs` its tensors read: as many as fit in what the largest
    tensor and its inputs take (so that a file tensor read for several is mostly read once)."""
    cost = {name: w.nbytes + sum(inputs[part].nbytes for part in reads[name]) for name, w in tensors.items()}
    groups, budget, size = [], max(cost.values(), default=0), 0
    for name, w in tensors.items():
        if not groups or size + cost[name] > budget:
            groups.append(([], set()))
            size = 0
        names, parts = groups[-1]
        size += w.nbytes + sum(inputs[part].nbytes for part in reads[name] - parts)
        names.append(name)
        parts |= reads[name]
    return groups


def one_by_one(tensors: dict) -> Iterator[tuple[str, mx.array]]:
    """`tensors`' items in order, each taken out of the dict as it is handed out, so that it is freed once used."""
    while tensors:
        name = next(iter(tensors))
        yield name, tensors.pop(name)


def sources(outputs: dict[str, mx.array], inputs: dict[str, mx.array]) -> dict[str, set[str]]:
    """The inputs (names) each lazy output is computed from, read off their graphs: MLX shows a graph's edges only in
    `export_to_dot`'s drawing of it, which names at most DRAWN arrays at a time, hence one drawing per block of
    inputs and block of outputs."""
    given = {id(w): name for name, w in inputs.items()}
    reads = {name: {given[id(w)]} if id(w) in given else set() for name, w in outputs.items()}
    computed = [(name, w) for name, w in outputs.items() if id(w) not in given]
    for first in range(0, len(inputs), DRAWN // 2):
        block = dict(list(inputs.items())[first : first + DRAWN // 2])
        for start in range(0, len(computed), DRAWN // 2):
            for name, found in drawn_sources(dict(computed[start : start + DRAWN // 2]), block).items():
                reads[name] |= found
    return reads


DRAWN = 1024  # the most keyword arguments nanobind passes: arrays `export_to_dot` can name in one drawing


def drawn_sources(outputs: dict[str, mx.array], inputs: dict[str, mx.array]) -> dict[str, set[str]]:
    """`sources` from one drawing, in which an array is `"label"`, a primitive a number and `a -> b` an edge."""
    label = {id(w): f"in{i}" for i, w in enumerate(inputs.values())}
    input_of = dict(zip(label.values(), inputs))
    for j, w in enumerate(outputs.values()):
        label.setdefault(id(w), f"out{j}")
    named = {label[id(w)]: w for w in [*inputs.values(), *outputs.values()]}
    with tempfile.TemporaryDirectory() as folder:
        mx.export_to_dot(f"{folder}/graph.dot", **named)
        drawing = Path(folder, "graph.dot").read_text()
    parents = defaultdict(list)
    for start, end in re.findall(r'^"?([^"\s]+)"? -> "?([^"\s]+)"?$', drawing, re.MULTILINE):
        parents[end].append(start)
    found: dict[str, frozenset] = {}

    def read_by(node: str) -> frozenset:
        if node in input_of:
            return frozenset([input_of[node]])
        if node not in found:
            found[node] = frozenset().union(*(read_by(parent) for parent in parents[node]))
        return found[node]

    return {name: set(read_by(label[id(w)])) for name, w in outputs.items()}


def check_room(out: Path, nbytes: int) -> None:
    """Refuse before writing when the disk under `out` has less room than the tensors' bytes (plus what the
    config, tokenizer and README take)."""
    needed, free = nbytes + (16 << 20), shutil.disk_usage(out.parent).free
    if needed > free:
        raise InvalidSettingError(
            f"not enough disk space for {out}: it needs {needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; "
            "free some space or write to another disk"
        )


def plan(quantize, bits, group_size, mode, recipe, dtype, spec) -> str:
    """What the conversion does, in words (the first progress line)."""
    cast = f", floats in {dtype}" if dtype else ""
    if quantize:
        width = f"{recipe} recipe" if recipe else f"{bits or MODES[mode][1]}-bit"
        return f"{width} {mode} quantization, group size {group_size or MODES[mode][0]}{cast}"
    if dtype:
        return f"{dtype} weights" + (" (packed weights unpacked)" if spec else "")
    return "tensors as stored" + (" (packed weights kept packed)" if spec else "")


def check_quantization(bits, group_size, mode, recipe) -> None:
    """Refuse settings `minimlx.quantize` or MLX would refuse, before anything is read or written."""
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
        raise InvalidSettingError(f"group size must be a positive integer, got {group_size!r}")
    width = group_size or MODES.get(mode, (64,))[0]
    probe = nn.Module()
    probe.layers, probe.proj = [], nn.Linear(8 * width, 8, bias=False)
    try:  # the same checks, and messages, as quantizing the model
        quantize_model(probe, bits, group_size, mode, recipe)
        mx.eval(probe.parameters())
    except ValueError as e:
        message = str(e).removeprefix("[quantize] ").rstrip(".")
        raise InvalidSettingError(f"cannot quantize so: {message[:1].lower()}{message[1:]}") from None


def read_source(path: Path, dtype: str | None) -> tuple[Checkpoint, dict | None, Callable[[Path], None]]:
    """The checkpoint to convert (its config as an MLX folder's config.json holds it), a GGUF file's stand-ins for its
    tensors (`gguf_standins`: the checkpoint holds those, and nothing is read yet) or None for a folder (whose tensors
    are read when evaluated), and a function that writes its tokenizer files into a folder."""
    if path.is_dir() or path.suffix.lower() != ".gguf":
        return read_checkpoint(path, dtype), None, lambda out: copy_side_files(path, out)
    _, standins, checkpoint = gguf_standins(path, DTYPES.get(dtype))
    config = checkpoint.config
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "per_frequency":
        config = {**config, "rope_scaling": llama3_scaling(scaling["factors"], config["rope_theta"], path.name)}
    words = "".join(part.capitalize() for part in config["model_type"].split("_"))
    checkpoint.config = {"architectures": [f"{words}ForCausalLM"], **config}
    return checkpoint, standins, lambda out: write_gguf_tokenizer(checkpoint.metadata, out)


def llama3_scaling(factors: list[float], base: float, name: str) -> dict | None:
    """The llama3 `rope_scaling` that gives the per-frequency factors of a GGUF's `rope_freqs` tensor (all that
    llama.cpp's converter keeps of it); None when every factor is 1.

    llama3's rule multiplies the wavelengths over original/low_freq_factor by `factor` (the largest factor), keeps
    those under original/high_freq_factor, and blends the ones between: 1 / ((1 - s) / factor + s), with s linear in
    1 / wavelength (s = (original / wavelength - low) / (high - low)). The line through the blended factors fixes
    original, low and high up to a common scale, which low_freq_factor = 1 (Llama 3.1's, 3.2's and 3.3's) removes;
    with fewer than two blended factors high_freq_factor is taken as 4 (theirs too) and original from the one blended
    factor or the boundary of the scaled ones. The result is checked against the factors.
    """
    given = np.array(factors, dtype=np.float64)
    factor = float(given.max())
    if factor == 1:
        return None
    dims = 2 * len(given)
    per_wavelength = base ** (-np.arange(0, dims, 2) / dims) / (2 * math.pi)
    blend = (1 / given - 1 / factor) / (1 - 1 / factor)
    blended = (given > 1) & (given < factor)
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(per_wavelength[blended], blend[blended], 1)
        high, original = float(1 - 1 / intercept), float(-slope / intercept)
    elif blended.any():
        high, original = 4.0, float((3 * blend[blended][0] + 1) / per_wavelength[blended][0])
    else:
        high, original = 4.0, float(1 / per_wavelength[given == factor].max())
    inv_freq = mx.array(per_wavelength * 2 * math.pi, dtype=mx.float32)
    for high_freq_factor, context in ((round(high, 3), int(round(original))), (high, original)):
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": context,
        }
        if np.allclose(np.array(inv_freq / llama3_inv_freq(inv_freq, scaling, context)), given, rtol=1e-5):
            return scaling
    raise CheckpointError(
        f"{name}'s rope_freqs tensor is not a llama3 RoPE scaling, which is all an MLX folder's config.json can say; "
        "convert the model's Hugging Face folder instead"
    )


def float_weights(weights: dict, spec: dict, dtype: str | None) -> dict:
    """Packed weights dequantized (into their scales' dtype, or `dtype`), float tensors cast to `dtype`."""
    scales = {module: weights[f"{module}.scales"].dtype for module in spec}
    dequantize_weights(weights, spec)
    for name, w in weights.items():
        if not mx.issubdtype(w.dtype, mx.floating):
            continue
        target = DTYPES[dtype] if dtype else scales.get(name.removesuffix(".weight"), w.dtype)
        if not mx.issubdtype(target, mx.floating):  # mxfp4/nvfp4 scales are uint8: stay in float32
            target = w.dtype
        weights[name] = w.astype(target) if w.dtype != target else w
    return weights


def quantize_floats(model: nn.Module, bits, group_size, mode, recipe) -> dict:
    """`minimlx.quantize` with the experts' routers left in float; returns its quantization entry."""
    routers = [
        (parent, key, child)
        for _, parent in model.named_modules()
        for key, child in parent.children().items()
        if isinstance(child, Router)
    ]
    for parent, key, _ in routers:
        parent.pop(key)
    try:
        return quantize_model(model, bits, group_size, mode, recipe)
    finally:
        for parent, key, child in routers:
            parent[key] = child


def kept_entry(spec: dict, entry: dict | None) -> dict:
    """The defaults of a source's packing kept as it is: its config's, or the settings most modules have."""
    keys = ("group_size", "bits", "mode")
    if entry and all(key in entry for key in keys[:2]):
        return {"group_size": entry["group_size"], "bits": entry["bits"], "mode": entry.get("mode", "affine")}
    common = Counter(tuple(q[key] for key in keys) for q in spec.values()).most_common(1)[0][0]
    return dict(zip(keys, common))


def quantized_modules(model: nn.Module) -> dict[str, dict]:
    """`{module path: {group_size, bits, mode}}` for each module of `model` that holds packed weights."""
    return {
        path: {"group_size": module.group_size, "bits": module.bits, "mode": getattr(module, "mode", "affine")}
        for path, module in model.named_modules()
        if "scales" in module and hasattr(module, "bits")
    }


def mlx_lm_entry(arch, packed: dict[str, dict], entry: dict) -> dict:
    """mlx-lm's `quantization` entry for the modules `packed` names (minimlx paths -> settings): the defaults
    of `entry`, plus one entry per mlx-lm module path whose settings differ from them."""
    defaults = {key: entry[key] for key in ("group_size", "bits", "mode")}
    result = dict(defaults)
    for theirs, ours in exported_modules(arch, list(packed)).items():
        settings = {tuple(sorted(packed[m].items())) for m in ours}
        if len(settings) > 1:
            raise InvalidSettingError(
                f"{', '.join(ours)} are written as one tensor ({theirs}) but would be quantized differently; "
                "quantize without a recipe"
            )
        chosen = dict(settings.pop())
        if chosen != defaults:
            result[theirs] = chosen
    return result


def exported_modules(arch, modules: list[str]) -> dict[str, list[str]]:
    """mlx-lm's module path -> the minimlx modules whose weights it holds, found by exporting one 1x1 weight
    per module that carries the module's number (so fused tensors, like GPT-2's `c_attn`, name all of theirs)."""
    tags = {f"{module}.weight": mx.array([[i]], dtype=mx.int32) for i, module in enumerate(modules)}
    found: dict[str, list[str]] = {}
    for name, tagged in export(arch, tags).items():
        for i in np.array(tagged).reshape(-1).tolist():
            found.setdefault(name.removesuffix(".weight"), []).append(modules[i])
    return found


def export(arch, tensors: dict) -> dict:
    """The model's tensors under mlx-lm's names (the plugin's `export_weights`)."""
    if not hasattr(arch, "export_weights"):
        raise UnsupportedArchitectureError(
            f"the {type(arch).__name__} plugin has no export_weights (its mlx-lm tensor names), so minimlx "
            "convert cannot write it; add one to the plugin"
        )
    return arch.export_weights(tensors)


def dominant_float_dtype(tensors: dict) -> str:
    """The float dtype holding the most elements (what config.json's `torch_dtype` records)."""
    sizes = Counter()
    for w in tensors.values():
        if mx.issubdtype(w.dtype, mx.floating):
            sizes[w.dtype] += w.size
    names = {v: k for k, v in DTYPES.items()}
    return names.get(sizes.most_common(1)[0][0], "float32") if sizes else "float32"


def write_shards(
    layout: dict[str, tuple], arrays: Iterator[tuple[str, mx.array]], out: Path, shard_size: int, say: Callable
) -> None:
    """Write the tensors `layout` names (shape, dtype) into shards of at most `shard_size` bytes (mlx-lm's file
    names and metadata), then the index: each shard's header first, then each tensor as `arrays` gives it, evaluated,
    written and dropped, so that one tensor at a time is held."""
    shards, size = [], 0
    for name, (shape, kind) in layout.items():
        nbytes = math.prod(shape) * kind.size
        if not shards or size + nbytes > shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = layout[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        with open(out / file, "wb") as f:
            f.write(safetensors_header(shard))
            for expected in shard:
                name, w = next(arrays)
                assert name == expected, f"{name} computed where {expected} was due"
                write_tensor(f, w)
                del w
                release_freed_memory()
        weight_map.update(dict.fromkeys(shard, file))
        nbytes = sum(math.prod(shape) * kind.size for shape, kind in shard.values())
        say(f"[{i + 1}/{len(shards)}] {file}: {len(shard)} tensors, {nbytes / 1e9:.3f} GB")
    if len(shards) > 1:
        total = sum(math.prod(shape) * kind.size for shape, kind in layout.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")


SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
    mx.complex64: "C64",
}


def safetensors_header(layout: dict[str, tuple]) -> bytes:
    """The start of a safetensors file holding tensors of `layout` (name -> shape, dtype), in that order: the
    header's length (8 bytes, little-endian) and its JSON, as `mx.save_safetensors` writes it (keys sorted, no
    spaces, `__metadata__` {"format": "mlx"}), padded with spaces to a multiple of 8 bytes as the format advises."""
    header, at = {"__metadata__": {"format": "mlx"}}, 0
    for name, (shape, kind) in layout.items():
        end = at + math.prod(shape) * kind.size
        header[name] = {"data_offsets": [at, end], "dtype": SAFETENSORS_DTYPES[kind], "shape": list(shape)}
        at = end
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


LIBC = ctypes.CDLL(None)  # the C library the process runs on, whose heap MLX and numpy allocate from


def release_freed_memory() -> None:
    """What a written tensor freed, back to the system: MLX's cached buffers, and on glibc the heap's free pages,
    which it keeps below its self-raising mmap threshold (converting benchmarks/gguf_memory.py's 24x2048 Q4_K_M file
    held 1.68 times its largest tensor over the runtime at its peak untrimmed, 1.18 times trimmed)."""
    mx.clear_cache()
    if hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


def write_tensor(file, w: mx.array) -> None:
    """Evaluate `w` and write its bytes, row-major, where `file` stands."""
    w = mx.contiguous(w)
    mx.eval(w)
    file.write(memoryview(w))


def write_config(config: dict, quantization: dict | None, torch_dtype: str, path: Path) -> None:
    """The source's config with mlx-lm's `quantization` (and its copy `quantization_config`) and the output dtype,
    RoPE settings in the layout mlx-lm reads."""
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config", "_name_or_path")}
    if "rope_parameters" in config:  # transformers 5's layout; mlx-lm reads transformers 4's rope_theta, rope_scaling
        rope = normalize_config(config)
        del config["rope_parameters"]
        keys = ("rope_theta", "rope_scaling", "partial_rotary_factor")
        config.update({key: rope[key] for key in keys if key in rope})
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    config["torch_dtype"] = torch_dtype
    if "dtype" in config:  # transformers 5's name for it
        config["dtype"] = torch_dtype
    path.write_text(json.dumps(dict(sorted(config.items())), indent=4) + "\n")


def copy_side_files(folder: Path, out: Path) -> None:
    """The tokenizer, chat template, generation settings and image processor files the source folder has."""
    for name in SIDE_FILES:
        if (folder / name).is_file():
            shutil.copy(folder / name, out / name)
    if not (folder / "tokenizer.json").is_file():
        import warnings

        warnings.warn(f"{folder} has no tokenizer.json, so {out} has none; copy it in before loading", stacklevel=3)


def write_gguf_tokenizer(metadata: dict, out: Path) -> None:
    """tokenizer.json rebuilt from the GGUF's vocabulary, plus the files transformers (and mlx-lm) read with it."""
    vocab = read_vocab(metadata)
    add_special_tokens(
        vocab.backend,
        vocab.bos_token if vocab.add_bos_token else None,
        vocab.eos_token if vocab.add_eos_token else None,
    )
    vocab.backend.save(str(out / "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    named = {
        f"{name}_token": tokens[int(metadata[f"tokenizer.ggml.{key}_token_id"])]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if f"tokenizer.ggml.{key}_token_id" in metadata
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{metadata.get('general.architecture')}.context_length", 2048)),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if vocab.chat_template:
        (out / "chat_template.jinja").write_text(vocab.chat_template)
    generation = {"eos_token_id": sorted(vocab.end_token_ids)}
    if vocab.bos_token is not None:
        generation = {"bos_token_id": vocab.backend.token_to_id(vocab.bos_token), **generation}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_readme(out: Path, source: Path, model_type: str, quantization: dict | None, torch_dtype: str) -> None:
    if quantization:
        how = f"{quantization['bits']}-bit {quantization['mode']} quantization, group size {quantization['group_size']}"
        if any(isinstance(v, dict) for v in quantization.values()):
            how += ", some modules at other settings (see config.json)"
    else:
        how = f"{torch_dtype} weights"
    (out / "README.md").write_text(
        "---\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n\n"
        f"# {out.name}\n\n"
        f"An MLX model (`{model_type}`, {how}) converted by `minimlx convert` from `{source.name}`.\n\n"
        f'```bash\nminimlx run --model {out.name} "Hello"\n'
        f'mlx_lm.generate --model {out.name} --prompt "Hello"\n```\n'
    )
