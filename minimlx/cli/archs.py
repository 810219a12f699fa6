"""`minimlx archs`: the registered architectures, where they come from, and the core parts they use."""

import json
import warnings

import click

from ..archs import registrations
from ..archs.config import normalize_config
from .group import main


def core_parts(plugin: type) -> list[str] | None:
    """The minimlx.core classes in the model the plugin builds from its `example_config`, caches included.

    The model is lazy, so nothing is allocated. None when the plugin has no example or it does not build.
    """
    example = getattr(plugin, "example_config", None)
    if example is None:
        return None
    try:
        model = plugin.from_config(normalize_config(example)).build()
        parts = model.modules() + model.make_cache()
    except Exception as e:  # a plugin's broken example must not hide the other architectures
        warnings.warn(f"{plugin.__module__}.{plugin.__name__}: example_config does not build ({e!r})", stacklevel=2)
        return None
    return sorted({type(p).__name__ for p in parts if type(p).__module__.startswith("minimlx.core.")})


def plugins() -> list[dict]:
    """One entry per plugin class: its model_type strings, source, class path and core parts."""
    rows: dict[type, dict] = {}
    for r in registrations():
        row = rows.setdefault(
            r.plugin,
            {"model_types": [], "source": r.source, "plugin": f"{r.plugin.__module__}.{r.plugin.__name__}"},
        )
        row["model_types"].append(r.model_type)
    for plugin, row in rows.items():
        row["parts"] = core_parts(plugin)
    return list(rows.values())


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def archs(as_json: bool):
    """List the registered architectures.

    One row per plugin: its model_type strings, its source (built-in, or the package that
    registered it), its class, and the minimlx.core parts of the model it builds from its
    example config ("?" when it has none).
    """
    rows = plugins()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = [("model_type", "source", "plugin", "core parts")] + [
        (", ".join(r["model_types"]), r["source"], r["plugin"], ", ".join(r["parts"]) if r["parts"] else "?")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(3)]
    for line in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[3])
