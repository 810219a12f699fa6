"""The `minimlx` command: its group (group.py) and one module per subcommand, each adding its command to `main`."""

from . import (  # noqa: F401
    adapter_effect,
    anatomy,
    archs,
    attention,
    bench,
    cache_prompt,
    chat,
    compare,
    convert,
    explain,
    fuse,
    hub,
    lens,
    lora,
    run,
    serve,
)
from .group import main

__all__ = ["main"]
