"""`python -m minimlx` runs the `minimlx` command."""

from .cli import main

main(prog_name="minimlx")
