"""`minimlx archs`: the registered architectures."""

import click

from ..archs import registrations
from . import main


@main.command()
def archs():
    """List every registered model_type and where its plugin comes from."""
    for r in registrations():
        click.echo(f"{r.model_type:<16} {r.source:<16} {r.plugin.__module__}.{r.plugin.__name__}")
