"""The `minimlx` command. Each subcommand lives in its own module of this package."""

import sys

import click

from ..errors import MinimlxError


class Group(click.Group):
    """Turns user errors into one line on stderr and exit status 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MinimlxError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="minimlx")
def main():
    """Run transformer language models with MLX and look inside them."""


def _add_commands():
    from . import archs  # noqa: F401  (each module registers its command on `main`)


_add_commands()
