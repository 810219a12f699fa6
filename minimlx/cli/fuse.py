"""`minimlx fuse`: fold an adapter into its base model and write an MLX folder, a Hugging Face folder or a GGUF file."""

import click

from .group import main


@main.command()
@click.option("--model", "-m", required=True, help="The base: checkpoint folder, .gguf file, repo id or short name.")
@click.option("--adapter-path", required=True, metavar="DIR", help="The adapter folder (PEFT's or mlx-lm's).")
@click.option("--save-path", required=True, metavar="OUT", help="Where to write: a new folder, or a .gguf file.")
@click.option(
    "--format",
    "format_",
    type=click.Choice(["mlx", "hf", "gguf"]),
    help="mlx: an MLX folder, packed again where the base was packed (the default); hf: a Hugging Face folder in "
    "float; gguf: a GGUF file (the default when OUT ends in .gguf).",
)
@click.option("--export-gguf", is_flag=True, help="Write a GGUF file (mlx-lm's spelling of --format gguf).")
@click.option(
    "--de-quantize", is_flag=True, help="Write a Hugging Face folder in float (mlx-lm's spelling of --format hf)."
)
@click.option("--dtype", metavar="D", help="float32, float16 or bfloat16 for the float tensors; default: the base's.")
@click.option(
    "--gguf-type",
    type=click.Choice(["f32", "f16", "bf16", "q8_0"]),
    help="The GGUF file's tensor type; default f16 (f32 for a float32 base).",
)
@click.option(
    "--llama-cpp",
    metavar="DIR",
    help="A llama.cpp checkout, whose convert_hf_to_gguf.py writes GGUF files; default: $MINIMLX_LLAMACPP.",
)
@click.option("--force", is_flag=True, help="Replace OUT when it exists.")
def fuse(model, adapter_path, save_path, format_, export_gguf, de_quantize, dtype, gguf_type, llama_cpp, force):
    """Fold the adapter in --adapter-path into --model and write the result to --save-path.

    Each adapted linear map gets its fused weight (W + scale B A; DoRA's magnitude applied); the rest of the
    model is written as the base holds it. An MLX folder loads in minimlx and mlx-lm, a Hugging Face folder in
    transformers (and vLLM), a GGUF file in llama.cpp, Ollama and LM Studio.
    """
    from ..errors import InvalidSettingError
    from ..tune.fuse import fuse as fuse_adapter

    asked = {f for f, given in (("gguf", export_gguf), ("hf", de_quantize), (format_, format_)) if given}
    if len(asked) > 1:
        raise InvalidSettingError(
            f"--format, --export-gguf and --de-quantize ask for {' and '.join(sorted(asked))}; give one"
        )
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    options = dict(format=asked.pop() if asked else None, dtype=dtype, gguf_type=gguf_type, llama_cpp=llama_cpp)
    fuse_adapter(model, adapter_path, save_path, **options, force=force, progress=say)
