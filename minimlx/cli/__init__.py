"""The `minimlx` command. Each subcommand lives in its own module of this package."""

import sys
import warnings

import click

from ..errors import MinimlxError


class Group(click.Group):
    """Turns user errors into one line on stderr and exit status 2, never a traceback; warnings into one line each."""

    def invoke(self, ctx):
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *where, **how: click.echo(f"warning: {message}", err=True)
            try:
                return super().invoke(ctx)
            except MinimlxError as e:
                click.echo(f"error: {e}", err=True)
                sys.exit(2)


dtype_option = click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16", "quantized"]),
    help="Execution dtype (default: float32 on the CPU, as stored on a GPU); quantized keeps packed weights (MLX folders, GGUF) packed.",
)
"""The `--dtype` option of every command that loads a model."""


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="minimlx")
def main():
    """Run transformer language models with MLX and look inside them."""


from . import anatomy, archs, bench, chat, compare, convert, lens, run  # noqa: E402, F401  (each adds its command to `main`)
