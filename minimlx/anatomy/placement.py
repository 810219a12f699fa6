"""The placement plan `minimlx anatomy MODEL --ranks N` prints: how a pipeline over N ranks would split a model
(`distributed.placement`), from a preset or a checkpoint's config alone, and whether each rank's share fits.
"""

from pathlib import Path

import mlx.nn as nn

from ..distributed.placement import plan
from ..errors import InvalidSettingError, ModelNotFoundError
from ..io.config import read_config
from ..io.resolve import resolve
from ..quantization import quantize
from .ledger import lazy_model, preset, presets


def model_at(name: str, bits: int | None = None) -> nn.Module:
    """The lazy model of a preset or a checkpoint folder's config, quantized to `bits` (affine, groups of 64)
    when given: shapes only, nothing is allocated."""
    if name in presets():
        model = lazy_model(preset(name), f"preset {name}")
    else:
        try:
            folder = resolve(name)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"{e}, or a preset: {', '.join(presets())}") from None
        if not Path(folder).is_dir():
            raise InvalidSettingError(f"{folder}: a placement plan reads a checkpoint folder's config.json or a preset")
        model = lazy_model(read_config(Path(folder)), str(Path(folder) / "config.json"))
    if bits is not None:
        quantize(model, bits=bits)
    return model


def gigabytes(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def plan_table(name: str, model: nn.Module, ranks: int, bits: int | None = None, memory_gb: float | None = None) -> str:
    """The placement plan as text: per rank its blocks, weight bytes, KV cache per 1K tokens, and whether the
    weights plus a full-context KV cache fit in `memory_gb`."""
    context = getattr(model.config, "max_positions", None)
    precision = f"{bits}-bit weights (groups of 64)" if bits else "weights as stored"
    fits_header = f"fits {memory_gb:g} GB" + (f" (+ KV for {context:,} tokens)" if context else "") if memory_gb else ""
    lines = [
        f"{name} as a pipeline over {ranks} ranks, {precision}",
        f"{'rank':<6}{'blocks':<16}{'weights':>12}{'KV cache / 1K tokens':>23}  {fits_header}".rstrip(),
    ]
    ranks_plan = plan(model, ranks)
    for r, rank in enumerate(ranks_plan):
        held = f"{rank.blocks.start}-{rank.blocks.stop - 1} ({len(rank.blocks)})"
        fits = ""
        if memory_gb:
            needed = rank.weight_bytes + rank.kv_bytes_per_1k * (context or 0) / 1024
            fits = f"{'yes' if needed <= memory_gb * 1e9 else 'no'} ({gigabytes(int(needed))})"
        lines.append(
            f"{r:<6}{held:<16}{gigabytes(rank.weight_bytes):>12}{gigabytes(rank.kv_bytes_per_1k):>23}  {fits}".rstrip()
        )
    lines.append(f"{'total':<22}{gigabytes(sum(rank.weight_bytes for rank in ranks_plan)):>12}")
    return "\n".join(lines)
