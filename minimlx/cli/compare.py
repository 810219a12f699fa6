"""`minimlx compare`: the same word in two contexts, layer by layer."""

import json

import click

from ..anatomy.similarity import compare_word
from ..loading import load
from .group import TEXT, dtype_option, inspected_adapter_option, inspection_dtype, main


@main.command()
@click.argument("model")
@click.argument("first", type=TEXT)
@click.argument("second", type=TEXT)
@click.option("--word", required=True, type=TEXT, help="A word that occurs in both sentences.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@inspected_adapter_option
@dtype_option
def compare(model, first, second, word, as_json, adapter, dtype):
    """Cosine similarity of WORD's hidden state in sentence FIRST and in sentence SECOND, per layer."""
    model, tokenizer = load(model, dtype=inspection_dtype(dtype), adapter=adapter)
    result = compare_word(model, tokenizer, first, second, word)
    if as_json:
        click.echo(json.dumps(result.to_dict(), ensure_ascii=False))
        return
    (a, b), (i, j) = result.tokens, result.positions
    click.echo(f"{word!r}: token {a!r} at position {i} of sentence one, {b!r} at position {j} of sentence two")
    click.echo(f"{'layer':<7}similarity")
    for label, value in zip(result.layers, result.similarity):
        click.echo(f"{label:<7}{value:.3f}")
