"""The architecture registry: `model_type` string -> plugin (a config dataclass that can build a model).

Built-in plugins register with the `@register(...)` decorator when `minimlx.archs` is imported.
Third-party packages register through the `minimlx.archs` entry-point group: each entry point
names a module (or object) whose import runs `@register`. Entry points load on the first lookup;
one that fails to import, or claims a `model_type` already taken, gives a warning naming its
package and is skipped, so the other architectures keep working.

A plugin that reads GGUF files lists llama.cpp's architecture names in its own `gguf_architectures`
(not inherited: a subclass that reads other files declares its own).
"""

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points

import mlx.nn as nn

from ..errors import CheckpointError, MinimlxError, UnsupportedArchitectureError
from .config import normalize_config

GROUP = "minimlx.archs"


@dataclass(frozen=True)
class Registration:
    model_type: str
    plugin: type
    source: str  # "built-in", or the distribution (pip package) that registered it


_registry: dict[str, Registration] = {}
_entry_points_loaded = False


def source_of(plugin: type) -> str:
    """ "built-in" for minimlx's own plugins, else the distribution whose entry point names the plugin's package.

    Found from the plugin's module rather than from load order, so a plugin imported directly before
    the entry points load is still credited to its package; a module no installed package declares
    is named as it is.
    """
    package = plugin.__module__.split(".")[0]
    if package == "minimlx":
        return "built-in"
    for ep in entry_points(group=GROUP):
        if ep.module.split(".")[0] == package:
            return ep.dist.name if ep.dist is not None else ep.value
    return plugin.__module__


def register(*model_types: str):
    """Class decorator: make a plugin config class the handler of `model_types`."""

    def decorate(plugin: type) -> type:
        source = source_of(plugin)
        for model_type in model_types:
            taken = _registry.get(model_type)
            if taken is not None:
                warnings.warn(
                    f"{source}: model_type {model_type!r} is already registered by {taken.source} "
                    f"({taken.plugin.__module__}.{taken.plugin.__name__}); keeping that one",
                    stacklevel=2,
                )
                continue
            _registry[model_type] = Registration(model_type, plugin, source)
        return plugin

    return decorate


def load_entry_points() -> None:
    """Import the plugins that installed packages declare in the `minimlx.archs` group (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=GROUP):
        try:
            ep.load()
        except BaseException as e:  # a broken plugin (even one that calls sys.exit) must not take the others down
            source = ep.dist.name if ep.dist is not None else ep.value
            warnings.warn(f"{source}: minimlx plugin {ep.name!r} failed to load and is skipped ({e!r})", stacklevel=2)


def registrations() -> list[Registration]:
    load_entry_points()
    return sorted(_registry.values(), key=lambda r: r.model_type)


def list_archs() -> list[str]:
    """The registered `model_type` strings."""
    return [r.model_type for r in registrations()]


def get_arch(model_type: str | None) -> type:
    """The plugin class registered for `model_type`."""
    load_entry_points()
    if isinstance(model_type, str) and model_type in _registry:
        return _registry[model_type].plugin
    raise UnsupportedArchitectureError(
        f"unsupported model_type {model_type!r}; registered: {', '.join(sorted(_registry))} "
        "(install a plugin package that registers it, see docs/adding-an-architecture.md)"
    )


def declared(attribute: str) -> dict[str, type]:
    """Each name the registered plugins list in their own (not inherited) `attribute` -> the first plugin listing it."""
    known = {}
    for registration in registrations():
        for name in vars(registration.plugin).get(attribute, ()):
            known.setdefault(name, registration.plugin)
    return known


def get_gguf_arch(architecture: str | None) -> type:
    """The plugin that reads GGUF files of llama.cpp architecture `architecture`."""
    known = declared("gguf_architectures")
    if architecture in known:
        return known[architecture]
    raise UnsupportedArchitectureError(
        f"GGUF architecture {architecture!r} has no plugin (GGUF architectures supported: {', '.join(sorted(known))}); "
        "use the model's Hugging Face folder, or install a plugin that reads it"
    )


def get_mmproj_arch(projector: str | None) -> type:
    """The plugin that reads llama.cpp mmproj files of projector type `projector` (their `clip.projector_type`):
    the one listing it in its own `mmproj_projectors`."""
    known = declared("mmproj_projectors")
    if projector in known:
        return known[projector]
    raise UnsupportedArchitectureError(
        f"mmproj projector type {projector!r} has no plugin (supported: {', '.join(sorted(known)) or 'none'}); use "
        "the model's Hugging Face folder"
    )


def plugin_config(config: dict, source: str = "the config"):
    """The plugin config that a config.json dict (read from `source`) describes.

    The config is normalized here, once (`normalize_config`: either transformers layout), so every plugin's
    `from_config` reads one layout. Errors name `source`; a plugin that fails other than with a MinimlxError is
    named too.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{source} must hold a JSON object, not {type(config).__name__}; fix it")
    model_type = config.get("model_type")
    plugin = get_arch(model_type)
    with reported(plugin, source, f"the plugin for model_type {model_type!r}"):
        return plugin.from_config(normalize_config(config))


def gguf_config(metadata: dict, tensors: dict, source: str) -> dict:
    """The config dict (config.json's form) that a GGUF file's metadata and tensors describe; errors name `source`
    as plugin_config's do."""
    reader = get_gguf_arch(metadata.get("general.architecture"))
    with reported(reader, source, f"the plugin for GGUF architecture {metadata.get('general.architecture')!r}"):
        return reader.gguf_config(metadata, tensors)


@contextmanager
def reported(plugin: type, source: str, who: str):
    """While `plugin` (described as `who`) reads `source`: a MinimlxError gains the source's name, any other
    error becomes a CheckpointError naming the plugin, its class and its package."""
    try:
        yield
    except MinimlxError as e:
        raise type(e)(f"{source}: {e}") from None
    except Exception as e:
        plugin_name = f"{plugin.__module__}.{plugin.__name__}, {source_of(plugin)}"
        raise CheckpointError(f"{source}: {who} ({plugin_name}) cannot read it: {e!r}") from None


def build_model(config: dict, source: str = "the config") -> nn.Module:
    """The model a config dict describes, with lazy (unallocated) parameters; `model.config` is the plugin config."""
    return build(plugin_config(config, source))


def build(arch) -> nn.Module:
    """The model of a plugin config, lazy; `model.config` is that plugin config."""
    model = arch.build()
    model.config = arch
    return model
