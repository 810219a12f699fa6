"""`minimlx pull`, `ls` and `rm`: models in the Hugging Face cache, fetched from the Hub (minimlx/io/hub.py)."""

import click

from .group import main


@main.command()
@click.argument("spec", metavar="REPO[:QUANT]")
def pull(spec):
    """Download a model from the Hugging Face Hub into its cache: a checkpoint folder repo, or one GGUF file of a
    GGUF repo picked by its quantization tag (REPO:Q4_K_M; Q4_K_M by default). Interrupted downloads resume."""
    from ..io.hub import pull as download

    click.echo(download(spec))


@main.command(name="ls")
def list_models():
    """The models in the Hugging Face cache: repo, size on disk, folder."""
    from ..io.hub import downloaded, hub_cache

    found = downloaded(hub_cache())
    if not found:
        click.echo(f"no models in {hub_cache()}; `minimlx pull ORG/NAME` downloads one")
        return
    width = max(len(entry.repo) for entry in found)
    for entry in found:
        click.echo(f"{entry.repo:<{width}}  {entry.size / 1e9:7.2f} GB  {entry.path}")


@main.command()
@click.argument("repo", metavar="ORG/NAME")
def rm(repo):
    """Delete a model from the Hugging Face cache."""
    from ..io.hub import hub_cache, remove

    entry = remove(hub_cache(), repo)
    click.echo(f"removed {entry.repo} ({entry.size / 1e9:.2f} GB) from {entry.path.parent}")
