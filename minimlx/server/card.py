"""How a loaded model is described to clients (Ollama's /api/tags, /api/show, /api/ps; the metrics' memory): its
name as clients write it, bytes held, parameters, family, file format, quantization, context, a digest of its
weights."""

import hashlib
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MinimlxError


@dataclass(frozen=True)
class ModelCard:
    """How the Ollama API describes the loaded model: its name as clients write it (`name:tag`), bytes held,
    parameters, family, file format, quantization, context and a digest of its weights."""

    name: str
    source: str  # the model as the server was given it (a path, a repo id, a short name)
    size: int
    parameters: int
    family: str
    format: str
    quantization: str
    context: int | None
    digest: str
    modified_at: str
    capabilities: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module, name: str, source: str, capabilities: tuple[str, ...]) -> "ModelCard":
        from ..io.resolve import resolve

        try:
            path = resolve(source)
            when = path.stat().st_mtime
        except (MinimlxError, OSError):  # a model handed over already loaded (tests, the Python API)
            path, when = Path(source), time.time()
        arrays = [a for _, a in tree_flatten(model.parameters())]
        config = model.config
        bits = {getattr(m, "bits", None) for m in model.modules() if isinstance(m, nn.QuantizedLinear)}
        dtype = next((a.dtype for a in arrays if mx.issubdtype(a.dtype, mx.floating)), mx.float32)
        quantization = f"Q{max(bits)}" if bits else str(dtype).removeprefix("mlx.core.").upper().replace("LOAT", "")
        digest = hashlib.sha256(repr(config).encode() + str(sum(a.nbytes for a in arrays)).encode()).hexdigest()
        short = Path(name).name.removesuffix(".gguf") if Path(name).exists() else name  # a path: its own name
        return cls(
            name=short if ":" in short else f"{short}:latest",
            source=name,
            size=sum(a.nbytes for a in arrays),
            parameters=parameter_count(model),
            family=type(config).__name__.removesuffix("Config").lower(),
            format="gguf" if str(path).endswith(".gguf") else "safetensors",
            quantization=quantization,
            context=config.max_positions,
            digest=digest,
            modified_at=datetime.fromtimestamp(when, timezone.utc).isoformat(),
            capabilities=capabilities,
        )

    def details(self) -> dict:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family],
            "parameter_size": parameter_size(self.parameters),
            "quantization_level": self.quantization,
        }

    def listing(self) -> dict:
        """The model as /api/tags lists it."""
        common = {"name": self.name, "model": self.name, "size": self.size, "digest": self.digest}
        return common | {"modified_at": self.modified_at, "details": self.details()}

    def answers_to(self, name: str | None) -> bool:
        """Whether a request naming `name` (`model`, with or without `:latest`) is for this model."""
        return name is None or name in (self.name, self.source) or f"{name}:latest" == self.name


def parameter_count(model: nn.Module) -> int:
    """The parameters `model` holds, a packed weight counted as the values it stands for (its scales not counted)."""
    count = 0
    for _, module in model.named_modules():
        own = module.parameters()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = own["weight"].shape[-2:]
            count += rows * packed * 32 // module.bits + (own["bias"].size if "bias" in own else 0)
            continue
        count += sum(a.size for a in own.values() if isinstance(a, mx.array))  # its own arrays, not its children's
    return count


def parameter_size(count: int) -> str:
    """Ollama's way of writing a parameter count: 135.0M, 8.0B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)
