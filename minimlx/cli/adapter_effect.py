"""`minimlx adapter-effect`: what an adapter changes in each block of its base model, on one prompt."""

import json

import click

from .group import TEXT, dtype_option, inspection_dtype, main


@main.command(name="adapter-effect")
@click.argument("model")
@click.argument("prompt", type=TEXT)
@click.option("--adapter", required=True, metavar="PATH", help="The adapter folder (PEFT's or mlx-lm's).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@dtype_option
def adapter_effect(model, prompt, adapter, as_json, dtype):
    """Trace MODEL with and without the adapter on PROMPT (no chat template): per block, what attention and the FFN
    add before and after, and how far the stream leaving the block moved."""
    from ..anatomy.adapted import adapter_effect as effect
    from ..loading import load

    adapted, tokenizer = load(model, dtype=inspection_dtype(dtype), adapter=adapter)
    result = effect(adapted, tokenizer.encode(prompt))
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(f"{'block':<7}{'attention adds':>22}{'FFN adds':>22}{'stream moved':>14}")
    for b in result.blocks:
        attn, mlp = f"{b.attn_before:.3g} -> {b.attn_after:.3g}", f"{b.mlp_before:.3g} -> {b.mlp_after:.3g}"
        click.echo(f"{b.layer:<7}{attn:>22}{mlp:>22}{b.shift:>13.1%}")
    words = [repr(tokenizer.decode([t])) for t in (result.next_before, result.next_after)]
    click.echo(f"next token: {words[0]} without the adapter, {words[1]} with it")
