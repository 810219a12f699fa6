"""Hugging Face `config.json` in the one layout the plugins read, and checked reads of its values.

Two generations of transformers write configs differently:
- transformers 4: `rope_theta` and `rope_scaling` (with `type` or `rope_type`), `torch_dtype`;
- transformers 5: `rope_parameters` holding `rope_theta` and the scaling, `dtype`.
`normalize_config` returns the first shape with `rope_scaling` either None or a dict whose
`rope_type` names the scaling, and `dtype`. It is idempotent. The registry calls it once (`registry.plugin_config`),
so a plugin's `from_config` reads this one layout.

Plugins read values with `number`, `flag`, `choice` and `rope_scaling`, which check type and range and raise
CheckpointError naming the key; the registry adds the file's name.
"""

import math

from ..errors import CheckpointError, UnsupportedArchitectureError

MISSING = object()
ROPE_TYPES = ("linear", "llama3", "yarn", "per_frequency", "proportional")
MAX_SIZE = 2**31 - 1  # MLX's largest array dimension
MAX_LAYERS = 4096  # over 30 times the deepest published model (126): more is a typo, and would not fit in memory


def normalize_config(config: dict) -> dict:
    """`config` in the one layout; a nested `text_config` (image-text checkpoints) too.

    Rope parameters per layer type (transformers 5's Gemma 3) become the full-attention layers' `rope_theta` and
    `rope_scaling` (else the first type's), and the sliding-window layers' `rope_local_base_freq` (transformers 4's
    key for them) and `rope_local_scaling`.
    """
    config = dict(config)
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = normalize_config(config["text_config"])
    rope = config.pop("rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" not in rope and rope:
        if isinstance(rope.get("sliding_attention"), dict):
            local = normalize_config({"rope_parameters": rope["sliding_attention"]})
            if "rope_theta" in local:
                config["rope_local_base_freq"] = local["rope_theta"]
            config["rope_local_scaling"] = local["rope_scaling"]
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if rope:
        rope = dict(_object(rope, "rope_parameters"))
        if "rope_theta" in rope:
            config["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            config.setdefault("partial_rotary_factor", rope.pop("partial_rotary_factor"))
        config["rope_scaling"] = rope
    scaling = config.get("rope_scaling")
    if scaling:
        scaling = dict(_object(scaling, "rope_scaling"))
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type") or "default"
        if "mrope_section" in scaling:  # Qwen's multimodal RoPE: which frequencies turn by which axis's position
            config["mrope_section"] = scaling.pop("mrope_section")
            scaling["rope_type"] = "default" if scaling["rope_type"] == "mrope" else scaling["rope_type"]
        config["rope_scaling"] = None if scaling["rope_type"] == "default" else scaling
    else:
        config["rope_scaling"] = None
    if "dtype" not in config and "torch_dtype" in config:
        config["dtype"] = config["torch_dtype"]
    config.pop("torch_dtype", None)
    return config


def _object(value, key: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"config key {key!r} must be an object, got {value!r}; fix the config")
    return value


def number(config: dict, key: str, default=MISSING, kind: type = int, low: int = 1, high: int = MAX_SIZE, label=None):
    """`config[key]` (`default` when absent or null) as `kind`: an int >= `low` (and <= `high`), or a positive
    finite float. CheckpointError naming the key (as `label`, when given) otherwise."""
    label = label or key
    value = config.get(key)
    if value is None:
        if default is MISSING:
            raise CheckpointError(f"config key {label!r} is missing; add it to the config")
        return default
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        ok = numeric and float(value).is_integer() and low <= value <= high
        wanted = f"an integer from {low} to {high:,}"
    else:
        ok, wanted = numeric and value > 0, "a positive number"
    if not ok:
        raise CheckpointError(f"config key {label!r} must be {wanted}, got {value!r}; fix the config")
    return kind(value)


def flag(config: dict, key: str, default: bool = False) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config key {key!r} must be true or false, got {value!r}; fix the config")
    return value


def choice(config: dict, key: str, default: str, choices) -> str:
    value = config.get(key, default)
    if value not in choices:
        raise UnsupportedArchitectureError(
            f"config key {key!r} is {value!r}, which minimlx does not support (supported: {', '.join(choices)})"
        )
    return value


def rope_scaling(config: dict, key: str = "rope_scaling") -> dict | None:
    """A normalized config's `rope_scaling` (or the scaling under `key`), its type one that minimlx computes and its
    factors positive."""
    scaling = config.get(key)
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    if kind not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope_scaling type {kind!r} is not supported (supported: default, {', '.join(ROPE_TYPES)}); fix the config"
        )
    if kind == "per_frequency":
        factors = scaling.get("factors")
        if not isinstance(factors, list) or not factors:
            raise CheckpointError(f"config key 'rope_scaling.factors' must be a list of numbers, got {factors!r}")
        for i in range(len(factors)):
            number(dict(enumerate(factors)), i, kind=float, label=f"rope_scaling.factors[{i}]")
    elif kind != "proportional" or "factor" in scaling:  # proportional RoPE's factor defaults to 1
        number(scaling, "factor", kind=float, label="rope_scaling.factor")
    return scaling


def require(condition: bool, message: str) -> None:
    """CheckpointError(`message`) unless `condition`: for rules between keys."""
    if not condition:
        raise CheckpointError(f"{message}; fix the config")


def sliding_window(config: dict) -> int | None:
    """The config's sliding attention window; None when null, 0 (as Qwen2-MoE writes) or `use_sliding_window: false`."""
    window = number(config, "sliding_window", None, low=0)
    return window if window and flag(config, "use_sliding_window", True) else None


def global_layers(config: dict, layers: int, pattern: int) -> tuple[int, ...]:
    """The layers that attend over the whole text while the others slide a window: from `layer_types`
    ("sliding_attention" or "full_attention" per layer, transformers 5), else each `sliding_window_pattern`-th
    (`pattern` when absent: 2 alternates, 6 is Gemma 3's 5 local : 1 global)."""
    kinds = config.get("layer_types")
    if kinds is None:
        every = number(config, "sliding_window_pattern", pattern)
        return tuple(i for i in range(layers) if (i + 1) % every == 0)
    require(
        isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {"sliding_attention", "full_attention"},
        f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} layers",
    )
    return tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")


def recurrent_layers(kinds, layers: int, recurrent: tuple[str, ...], attention: tuple[str, ...]) -> tuple[int, ...]:
    """The layers whose kind (of a hybrid's `layer_types`, one per layer) is in `recurrent`; a kind in neither
    `recurrent` nor `attention` is refused, naming it, before any tensor is read."""
    require(
        isinstance(kinds, list) and len(kinds) == layers, f"layer_types must name a kind for each of {layers} layers"
    )
    known = recurrent + attention
    unknown = sorted({k for k in kinds if k not in known}, key=str)
    if unknown:
        raise CheckpointError(
            f"layer_types holds {unknown}, which no minimlx layer computes (known: {', '.join(known)})"
        )
    return tuple(i for i, kind in enumerate(kinds) if kind in recurrent)
