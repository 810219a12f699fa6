"""`minimlx lens`: what each layer would predict if it were the last (the logit lens)."""

import json

import click

from ..anatomy.lens import LensResult, logit_lens
from ..loading import load
from .group import TEXT, dtype_option, inspected_adapter_option, inspection_dtype, main
from .plots import pyplot, save, shown


def grid(result: LensResult, longest: int = 16) -> str:
    """Rows: the embedding and each block (last at the bottom); columns: prompt positions; cell: top token, probability.

    Tokens are shown quoted (leading spaces matter), cut to `longest` characters.
    """
    header = [repr(t)[:longest] for t in result.tokens]
    cells = [
        [f"{repr(t[0])[:longest]} {p[0]:.2f}" for t, p in zip(tokens, probs)]
        for tokens, probs in zip(result.top_tokens, result.top_probs)
    ]
    width = max(len(c) for c in header + [c for row in cells for c in row]) + 2
    lines = [" " * 7 + "".join(h.ljust(width) for h in header)]
    lines += [f"{label:<7}" + "".join(c.ljust(width) for c in row) for label, row in zip(result.layers, cells)]
    return "\n".join(line.rstrip() for line in lines)


def draw(result: LensResult, path: str, plt) -> None:
    """Heatmap of the top token's probability per layer and position, each cell labelled with the token."""
    probs = [[p[0] for p in row] for row in result.top_probs]
    rows, columns = len(probs), len(result.tokens)
    figure, axes = plt.subplots(figsize=(1.3 * columns + 2, 0.32 * rows + 1.5))
    image = axes.imshow(probs, origin="lower", aspect="auto", cmap="Blues", vmin=0, vmax=1)
    for r, row in enumerate(result.top_tokens):
        for c, ranks in enumerate(row):
            axes.text(
                c,
                r,
                shown(ranks[0]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if probs[r][c] > 0.6 else "black",
            )
    axes.set_xticks(range(columns), [shown(t) for t in result.tokens], rotation=45, ha="right")
    axes.set_yticks(range(rows), result.layers, fontsize=7)
    axes.set_xlabel("prompt position (the cell predicts the token after it)")
    axes.set_ylabel("read after")
    figure.colorbar(image, ax=axes, label="probability of the top token")
    save(plt, figure, path)


@main.command()
@click.argument("model")
@click.argument("prompt", type=TEXT)
@click.option("--top-k", default=5, show_default=True, help="Guesses kept per cell (the grid shows the first).")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
@click.option("--png", type=click.Path(dir_okay=False), help="Also draw the grid as a heatmap (needs matplotlib).")
@inspected_adapter_option
@dtype_option
def lens(model, prompt, top_k, as_json, png, adapter, dtype):
    """Apply the final norm and lm_head after every block: the logit lens of PROMPT (no chat template)."""
    plt = pyplot("--png", png) if png else None
    model, tokenizer = load(model, dtype=inspection_dtype(dtype), adapter=adapter)
    result = logit_lens(model, tokenizer, prompt, top_k)
    click.echo(json.dumps(result.to_dict(), ensure_ascii=False) if as_json else grid(result))
    if png:
        draw(result, png, plt)
