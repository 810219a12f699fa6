"""`minimlx convert`: write a checkpoint as an MLX folder (quantized or not) that minimlx and mlx-lm load."""

import click

from .group import main


@main.command()
@click.argument("source")
@click.argument("out")
@click.option(
    "--quantize",
    "-q",
    is_flag=True,
    help="Quantize: 4-bit affine in groups of 64 (packed sources keep their group size).",
)
@click.option("--bits", type=int, metavar="B", help="Bits per quantized weight (affine: 2, 3, 4, 5, 6, 8); implies -q.")
@click.option("--group-size", type=int, metavar="G", help="Weights per scale (affine: 32, 64, 128); implies -q.")
@click.option(
    "--mode",
    default="affine",
    show_default=True,
    metavar="M",
    help="affine, mxfp4, mxfp8 or nvfp4 (the last three imply -q).",
)
@click.option(
    "--recipe",
    metavar="R",
    help="mixed-2-6, mixed-3-4, mixed-3-6 or mixed-4-6: more bits where they matter; implies -q.",
)
@click.option(
    "--dtype",
    metavar="D",
    help="float32, float16 or bfloat16: cast the float weights (unpacks packed ones without -q).",
)
@click.option("--force", is_flag=True, help="Replace OUT when it is a folder that holds files.")
def convert(source, out, **options):
    """Convert SOURCE into an MLX folder OUT, quantized or not.

    SOURCE is a Hugging Face or MLX checkpoint folder, a .gguf file, a Hugging Face repo id or
    smollm2-135m. OUT (a new or empty folder, or any folder with --force) gets config.json, safetensors
    shards under mlx-lm's tensor names, the tokenizer and a README.md; minimlx and mlx-lm both load it.
    Without -q or --dtype the tensors are written as stored (packed ones stay packed). The model is read,
    converted and written one shard at a time; a line per shard goes to stderr. OUT appears only once it
    is whole: an interrupted conversion leaves it as it was.
    """
    from ..convert import convert as convert_checkpoint

    convert_checkpoint(source, out, **options, progress=lambda line: click.echo(line, err=True))
