"""Which kind of forward pass is running: the engine marks its decode steps (`decode_steps`).

A device form may compute a decode step's products less exactly where that is much faster: the CPU's native
kernel multiplies 8-bit-quantized inputs by packed weights with integer dot products there (cpu/linear.py).
Prompts (prefill, a prompt-cache hit's last token, a conversation's new turn) are never marked, so a prompt's
first answer token is the same however much of it was cached. Core's own parts compute every pass alike.
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
