"""`minimlx attention`: which earlier tokens each token of a prompt reads, in one layer."""

import click

from ..anatomy.attention import AttentionPattern, attention_pattern
from ..loading import load
from .group import TEXT, dtype_option, inspected_adapter_option, inspection_dtype, main
from .plots import pyplot, save, shown


def heads_shown(pattern: AttentionPattern) -> str:
    return f"head {pattern.head}" if pattern.head is not None else f"mean of its {pattern.heads} heads"


def table(pattern: AttentionPattern, longest: int = 12) -> str:
    """Rows: the tokens; columns: the tokens each row can read (itself and those before it);
    cells: the percentage of the row's attention."""
    labels = [repr(t)[:longest] for t in pattern.tokens]
    width = max(7, *map(len, labels)) + 2
    lines = [
        f"layer {pattern.layer}, {heads_shown(pattern)}: % of each row's attention on each token up to it",
        " " * width + "".join(label.rjust(width) for label in labels),
    ]
    for t, row in enumerate(pattern.weights):
        lines.append(labels[t].ljust(width) + "".join(f"{100 * w:{width}.1f}" for w in row[: t + 1]))
    return "\n".join(lines)


def draw(pattern: AttentionPattern, path: str, plt) -> None:
    """Heatmap of the pattern: a row per token, its attention over the tokens up to it, in percent when few enough."""
    count = len(pattern.tokens)
    weights = [[w if s <= t else float("nan") for s, w in enumerate(row)] for t, row in enumerate(pattern.weights)]
    figure, axes = plt.subplots(figsize=(0.55 * count + 2.5, 0.45 * count + 1.8))
    image = axes.imshow(weights, cmap="Blues", vmin=0, vmax=1)
    if count <= 16:
        for t, row in enumerate(weights):
            for s, w in enumerate(row[: t + 1]):
                color = "white" if w > 0.6 else "black"
                axes.text(s, t, f"{100 * w:.0f}", ha="center", va="center", fontsize=7, color=color)
    labels = [shown(t) for t in pattern.tokens]
    axes.set_xticks(range(count), labels, rotation=45, ha="right", fontsize=8)
    axes.set_yticks(range(count), labels, fontsize=8)
    axes.set_xlabel("token read (key)")
    axes.set_ylabel("token reading (query)")
    axes.set_title(f"layer {pattern.layer}, {heads_shown(pattern)}")
    figure.colorbar(image, ax=axes, label="share of the row's attention")
    save(plt, figure, path)


@main.command()
@click.argument("model")
@click.argument("prompt", type=TEXT)
@click.option("--layer", type=int, help="The layer to show, from 0 (default: the last).")
@click.option("--head", type=int, help="The query head to show, from 0 (default: the mean over the layer's heads).")
@click.option(
    "--plot", type=click.Path(dir_okay=False), help="Also draw the pattern as a heatmap PNG (needs matplotlib)."
)
@inspected_adapter_option
@dtype_option
def attention(model, prompt, layer, head, plot, adapter, dtype):
    """Which earlier tokens each token of PROMPT reads: one layer's attention weights (no chat template)."""
    plt = pyplot("--plot", plot) if plot else None  # before the model loads: a missing matplotlib fails at once
    model, tokenizer = load(model, dtype=inspection_dtype(dtype), adapter=adapter)
    pattern = attention_pattern(model, tokenizer, prompt, layer, head)
    click.echo(table(pattern))
    if plot:
        draw(pattern, plot, plt)
