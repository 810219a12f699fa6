"""`minimlx anatomy`: where a model's parameters sit."""

import json

import click

from ..anatomy.depth import depth_rows
from ..anatomy.depth import depth_table as seed_depth_table
from ..anatomy.ledger import COMPONENTS, Ledger, ledger, presets
from ..errors import ModelNotFoundError
from ..io.resolve import resolve
from ..loading import load
from .group import main


def model_ledger(name: str) -> Ledger:
    """A preset or a checkpoint folder is counted from its config alone; a single-file model is loaded."""
    if name in presets():
        return ledger(name)
    try:
        path = resolve(name)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"{e}, or a preset: {', '.join(presets())}") from None
    if path.is_dir():
        return ledger(path)
    model, _ = load(path, dtype="quantized")  # as stored: the bytes column shows the file's packing
    return ledger(model)


def short(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"


def size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def describe(name: str, entry: Ledger) -> str:
    s = entry.shape
    text = f"{name}: {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads"
    if s["experts"]:
        shared = " + shared" if s["shared_experts"] else ""
        text += f", {s['moe_layers']} MoE layers of {s['experts']} experts (top {s['experts_per_token']}{shared})"
    return text


def table(name: str, entry: Ledger) -> str:
    lines = [describe(name, entry), f"{'component':<20}{'parameters':>18}{'%':>8}{'bytes':>12}"]
    for kind, params in entry.components.items():
        percent = 100 * params / entry.total
        bar = "█" * round(percent / 2)
        lines.append(f"{COMPONENTS[kind]:<20}{params:>18,}{percent:>7.1f}%{size(entry.nbytes[kind]):>12}  {bar}")
    if entry.tied_head:
        lines.append(f"{'lm_head':<20}{'tied':>18}   (shares the token embedding's matrix, counted there)")
    lines.append(f"{'total':<20}{entry.total:>18,}{100:>7.1f}%{size(entry.total_bytes):>12}")
    if entry.active != entry.total:
        lines.append(f"{'active per token':<20}{entry.active:>18,}{100 * entry.active / entry.total:>7.1f}%")
    return "\n".join(line.rstrip() for line in lines)


def layer_table(entry: Ledger) -> str:
    kinds = [k for k in COMPONENTS if any(k in layer for layer in entry.layers)]
    lines = [f"{'layer':<7}" + "".join(f"{COMPONENTS[k]:>18}" for k in kinds) + f"{'total':>18}"]
    for i, layer in enumerate(entry.layers):
        counts = "".join(f"{layer[k]:>18,}" if k in layer else f"{'-':>18}" for k in kinds)
        lines.append(f"{i:<7}{counts}{sum(layer.values()):>18,}")
    return "\n".join(lines)


def depth_table(entries: dict[str, Ledger]) -> str:
    width = max(len("model"), *map(len, entries)) + 2
    lines = [f"{'model':<{width}}{'layers':>7}{'d_model':>9}{'heads':>7}{'experts':>20}{'total':>10}{'active':>10}"]
    for name, entry in entries.items():
        s = entry.shape
        experts = f"{s['experts']} top {s['experts_per_token']}" + (" +shared" if s["shared_experts"] else "")
        lines.append(
            f"{name:<{width}}{s['layers']:>7}{s['d_model']:>9}{s['heads']:>7}{experts if s['experts'] else '-':>20}"
            f"{short(entry.total):>10}{short(entry.active):>10}"
        )
    return "\n".join(lines)


def print_depth_table(ctx: click.Context, _, wanted: bool) -> None:
    """`--depth-table` is an action, like `--version`: it prints the seed's table and ends the command."""
    if wanted:
        click.echo(seed_depth_table(depth_rows()))
        ctx.exit()


@main.command()
@click.option(
    "--depth-table",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=print_depth_table,
    help="Print the seed's table of ten 2024-2025 models (params, active, width, layers, heads) "
    "from the presets, and exit.",
)
@click.argument("models", nargs=-1, required=True, metavar="MODEL_OR_PRESET...")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the table.")
@click.option("--per-layer", is_flag=True, help="Also count every layer.")
@click.option("--compare", is_flag=True, help="Compare several models: layers, width, heads, experts, total, active.")
@click.option(
    "--ranks", type=click.IntRange(min=1), help="Print the placement plan of a pipeline over this many machines."
)
@click.option(
    "--bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    help="With --ranks: weights quantized to this many bits.",
)
@click.option(
    "--memory", type=click.FloatRange(min=0, min_open=True), help="With --ranks: each machine's memory in GB."
)
def anatomy(models, as_json, per_layer, compare, ranks, bits, memory):
    """Count the parameters of a model or preset by component.

    MODEL_OR_PRESET is a preset (gpt2, llama3-8b, qwen3-8b, qwen3-32b, qwen3-235b-a22b, deepseek-v3,
    deepseek-v2-lite, kimi-k2, gpt-oss-20b, gpt-oss-120b, glm-4-9b, gemma-3-12b, gemma-3-27b), a
    checkpoint folder (counted from config.json, no weights read) or a model name that `minimlx run` accepts.
    """
    if len(models) > 1 and not compare:
        raise click.UsageError("give one model, or pass --compare to compare several")
    if ranks is None and (bits or memory):
        raise click.UsageError("--bits and --memory go with --ranks N (the placement plan)")
    if ranks is not None:
        from ..anatomy.placement import model_at, plan_table

        bits = int(bits) if bits else None
        click.echo(plan_table(models[0], model_at(models[0], bits), ranks, bits, memory))
        return
    entries = {name: model_ledger(name) for name in models}
    if as_json:
        out = {name: entry.to_dict(per_layer) for name, entry in entries.items()}
        click.echo(json.dumps(out if compare else out[models[0]], indent=2))
    elif compare:
        click.echo(depth_table(entries))
    else:
        entry = entries[models[0]]
        click.echo(table(models[0], entry))
        if per_layer:
            click.echo("\n" + layer_table(entry))
