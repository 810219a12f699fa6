"""Which kind of forward pass is running: the engine marks its decode steps (`decode_steps`) and the passes that
feed a prompt into a cache for generation (`prompt_steps`).

A device form may compute these passes' products less exactly where that is much faster: the CPU's native kernel
multiplies 8-bit-quantized inputs by packed weights with integer dot products there (cpu/linear.py), a prompt's by a
GEMM whose every row sums as it does alone, so that a prompt's first answer token is the same however much of it was
cached or however it was chunked. Passes outside the engine (a model called directly, the anatomy tools) are not
marked. Core's own parts compute every pass alike.
"""

import contextlib
import contextvars
from collections.abc import Iterator

decoding_var = contextvars.ContextVar("decoding", default=False)


@contextlib.contextmanager
def decode_steps() -> Iterator[None]:
    """The forward passes inside are decode steps (or speculative checks of drafted tokens, which must compute
    as the decode steps they stand for)."""
    token = decoding_var.set(True)
    try:
        yield
    finally:
        decoding_var.reset(token)


def decoding() -> bool:
    """Whether the forward pass being built is a decode step."""
    return decoding_var.get()


prompting_var = contextvars.ContextVar("prompting", default=False)


@contextlib.contextmanager
def prompt_steps() -> Iterator[None]:
    """The forward passes inside feed a prompt (or a chunk of one) into a cache for generation."""
    token = prompting_var.set(True)
    try:
        yield
    finally:
        prompting_var.reset(token)


def prompting() -> bool:
    """Whether the forward pass being built feeds a prompt for generation."""
    return prompting_var.get()
