"""The parameter ledger: where a model's parameters sit, by component, per layer and in total.

Components are read off parameter paths (the model naming contract), never off an architecture
name: `embed` is the token embedding, `positions` the position embedding, `head` the lm_head,
any `*norm` module a norm, and inside a layer `attn` is attention while `ffn` splits into the
MoE `router`, the routed `experts`, the `shared_experts` and, for a dense layer, the FFN itself (a mixture that
runs beside the dense FFN, Gemma 4's `moe`, splits into its `router` and `experts` the same way).
Adapters (`minimlx.tune`'s LoRA and DoRA forms, `lora_a`, `lora_b` and `magnitude`, and the stacks of adapters a
server applies per row, `decode.adapters`) count apart from the maps they adapt, whose own weights stay in place.

A ledger built from a config never allocates weights: the model is built lazily and only the
shapes of its (never evaluated) arrays are read, which is why DeepSeek-V3's 671B parameters
are counted in about a second. Quantized modules count logical parameters (what the float
original holds), and bytes report what the arrays actually occupy.
"""

import json
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..archs import build_model
from ..archs.config import normalize_config
from ..errors import ModelNotFoundError
from ..io.checkpoint import DTYPES
from ..io.config import read_config

COMPONENTS = {
    "token_embedding": "token embedding",
    "position_embedding": "position embedding",
    "attention": "attention",
    "ffn": "FFN",
    "router": "MoE router",
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "norms": "norms",
    "lm_head": "lm_head",
    "adapters": "adapters (LoRA/DoRA)",
    "other": "other",
}
FFN_PARTS = {
    "router": "router",
    "experts": "routed_experts",
    "shared_experts": "shared_experts",
    "shared_gate": "shared_experts",
}
TOP_LEVEL = {"embed": "token_embedding", "positions": "position_embedding", "head": "lm_head"}
QUANTIZATION_DATA = ("scales", "biases")
ADAPTER_PARAMETERS = ("lora_a", "lora_b", "magnitude", "lora_scale", "lora_rescale")


def component(path: str) -> str:
    """The component a parameter belongs to, from its path (e.g. `layers.3.ffn.experts.up_proj.weight`)."""
    parts = path.split(".")
    if parts[-1] in ADAPTER_PARAMETERS:
        return "adapters"
    if len(parts) > 1 and parts[-2].endswith("norm"):
        return "norms"
    if parts[0] != "layers":
        return TOP_LEVEL.get(parts[0], "other")
    if parts[2] == "attn":
        return "attention"
    if parts[2] == "ffn":
        return FFN_PARTS.get(parts[3], "ffn")
    if parts[2] == "moe":  # a mixture beside the dense FFN (Gemma 4): its router and experts
        return FFN_PARTS.get(parts[3], "other")
    return "other"


def _mixture(layer: nn.Module) -> nn.Module | None:
    """A layer's mixture of experts: its FFN, or one that runs beside a dense FFN (`moe`), or none."""
    if hasattr(layer.ffn, "num_experts"):
        return layer.ffn
    return layer.moe if "moe" in layer else None


def presets() -> list[str]:
    """The names of the published configs shipped with minimlx."""
    folder = resources.files("minimlx.anatomy").joinpath("presets")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def preset(name: str) -> dict:
    """A shipped published config by name (`gpt2`, `llama3-8b`, `deepseek-v3`, ...)."""
    if name not in presets():
        raise ModelNotFoundError(f"no preset named {name!r}; the presets are: {', '.join(presets())}")
    return json.loads(resources.files("minimlx.anatomy").joinpath("presets", f"{name}.json").read_text())


def lazy_model(config: dict, source: str = "the config") -> nn.Module:
    """The model a config describes, unallocated, with parameters in the checkpoint's dtype."""
    model = build_model(config, source)
    dtype = DTYPES.get(normalize_config(config).get("dtype"))
    if dtype is not None:
        model.set_dtype(dtype)
    return model


@dataclass
class Ledger:
    """Parameter counts and bytes by component (`components`, `nbytes`) and per layer (`layers`)."""

    components: dict[str, int]
    nbytes: dict[str, int]
    layers: list[dict[str, int]]
    active: int
    tied_head: bool
    shape: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def to_dict(self, per_layer: bool = False) -> dict:
        out = {
            "total": self.total,
            "active": self.active,
            "bytes": self.total_bytes,
            "tied_head": self.tied_head,
            "components": self.components,
            "component_bytes": self.nbytes,
            "shape": self.shape,
        }
        if per_layer:
            out["layers"] = self.layers
        return out


def _quantized_bits(model: nn.Module) -> dict[str, int]:
    """Bits per weight of every quantized module, by path: a packed uint32 holds 32 / bits weights."""
    return {
        path: module.bits for path, module in model.named_modules() if hasattr(module, "bits") and "scales" in module
    }


def _shape(model: nn.Module) -> dict:
    moe = [mixture for mixture in map(_mixture, model.layers) if mixture is not None]
    # the first attention layer's query heads: a hybrid stack (Qwen3.5) opens with recurrent layers, which have none
    heads = next((layer.attn.heads for layer in model.layers if hasattr(layer.attn, "heads")), None)
    return {
        "layers": len(model.layers),
        "d_model": model.norm.weight.shape[-1],
        "heads": heads,
        "experts": moe[0].num_experts if moe else None,
        "experts_per_token": moe[0].experts_per_token if moe else None,
        "shared_experts": bool(moe) and "shared_experts" in moe[0],
        "moe_layers": len(moe),
    }


def _logical_size(path: str, array, bits: dict[str, int]) -> int:
    """Parameters an array stands for: a packed quantized weight holds 32 / bits per uint32, scales/biases none."""
    module, name = path.rpartition(".")[::2]
    if module not in bits:
        return array.size
    if name in QUANTIZATION_DATA:
        return 0
    return array.size * 32 // bits[module] if name == "weight" else array.size


def count(model: nn.Module) -> Ledger:
    """The ledger of a built model, lazy or loaded: only parameter shapes and dtypes are read."""
    bits = _quantized_bits(model)
    components, nbytes = Counter(), Counter()
    layers = [Counter() for _ in model.layers]
    for path, array in tree_flatten(model.parameters()):
        kind, params = component(path), _logical_size(path, array, bits)
        components[kind] += params
        nbytes[kind] += array.nbytes
        if path.startswith("layers."):
            layers[int(path.split(".")[1])][kind] += params

    active = sum(components.values())
    for layer, counts in zip(model.layers, layers):
        mixture = _mixture(layer)
        if mixture is not None:
            routed = counts["routed_experts"]
            active -= routed - routed * mixture.experts_per_token // mixture.num_experts
    return Ledger(
        _in_order(components), _in_order(nbytes), [_in_order(c) for c in layers], active, model.tied_head, _shape(model)
    )


def _in_order(counts: dict[str, int]) -> dict[str, int]:
    return {name: counts[name] for name in COMPONENTS if name in counts}


def ledger(model_or_config: nn.Module | dict | str | Path) -> Ledger:
    """Count parameters of a model, a config dict, a preset name or a checkpoint folder's config.json."""
    if isinstance(model_or_config, nn.Module):
        return count(model_or_config)
    if isinstance(model_or_config, dict):
        return count(lazy_model(model_or_config))
    name = str(model_or_config)
    if name in presets():
        return count(lazy_model(preset(name), f"preset {name}"))
    if Path(name).is_dir():
        return count(lazy_model(read_config(Path(name)), str(Path(name) / "config.json")))
    raise ModelNotFoundError(
        f"{name!r} is neither a preset ({', '.join(presets())}) nor a checkpoint folder; pass one of those"
    )
