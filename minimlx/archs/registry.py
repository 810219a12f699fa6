"""The architecture registry: `model_type` string -> plugin (a config dataclass that can build a model).

Built-in plugins register with the `@register(...)` decorator when `minimlx.archs` is imported.
Third-party packages register through the `minimlx.archs` entry-point group: each entry point
names a module (or object) whose import runs `@register`. Entry points load on the first lookup;
one that fails to import, or claims a `model_type` already taken, gives a warning and is skipped.
"""

import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points

from ..errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class Registration:
    model_type: str
    plugin: type
    source: str  # "built-in" or the distribution that registered it


_registry: dict[str, Registration] = {}
_current_source = "built-in"
_entry_points_loaded = False


def register(*model_types: str):
    """Class decorator: make a plugin config class the handler of `model_types`."""

    def decorate(plugin: type) -> type:
        for model_type in model_types:
            taken = _registry.get(model_type)
            if taken is not None:
                warnings.warn(
                    f"{_current_source}: model_type {model_type!r} is already registered by {taken.source} "
                    f"({taken.plugin.__module__}); keeping that one",
                    stacklevel=2,
                )
                continue
            _registry[model_type] = Registration(model_type, plugin, _current_source)
        return plugin

    return decorate


def load_entry_points() -> None:
    """Import the plugins that installed packages declare in the `minimlx.archs` group (once)."""
    global _entry_points_loaded, _current_source
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="minimlx.archs"):
        _current_source = ep.dist.name if ep.dist is not None else ep.value
        try:
            ep.load()
        except Exception as e:  # a broken plugin must not take the others down
            warnings.warn(f"minimlx plugin {ep.name!r} from {_current_source} failed to load: {e}", stacklevel=2)
        finally:
            _current_source = "built-in"


def registrations() -> list[Registration]:
    load_entry_points()
    return sorted(_registry.values(), key=lambda r: r.model_type)


def list_archs() -> list[str]:
    """The registered `model_type` strings."""
    return [r.model_type for r in registrations()]


def get_arch(model_type: str | None) -> type:
    """The plugin class registered for `model_type`."""
    load_entry_points()
    if model_type in _registry:
        return _registry[model_type].plugin
    raise UnsupportedArchitectureError(
        f"unsupported model_type {model_type!r}; registered: {', '.join(sorted(_registry))} "
        "(install a plugin package that registers it, see docs/adding-an-architecture.md)"
    )
