"""The `minimlx` command: its group (group.py) and one module per subcommand, each adding its command to `main`."""

from . import anatomy, archs, attention, bench, cache_prompt, chat, compare, convert, explain, hub, lens, run, serve  # noqa: F401
from .group import main

__all__ = ["main"]
