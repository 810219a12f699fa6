"""The step watchdog: a rank stopped with its connections open (SIGSTOP, a hung machine) makes no collective
fail, so the others would wait for ever; a step that waits too long ends the process instead."""

import os
import sys
import threading
import time
from contextlib import contextmanager

RANK_TIMEOUT = 45  # seconds one engine step may wait on the other ranks (MINIMLX_RANK_TIMEOUT)


def rank_timeout() -> float:
    """How long a step may wait on the other ranks: MINIMLX_RANK_TIMEOUT seconds, else RANK_TIMEOUT."""
    return float(os.environ.get("MINIMLX_RANK_TIMEOUT", RANK_TIMEOUT))


class Watchdog:
    """Ends this process (status 1, one line) when a guarded stretch runs past `seconds`: a rank stopped (SIGSTOP,
    a hung machine) keeps its connections open, so the others' collectives would wait forever, not fail."""

    def __init__(self, seconds: float):
        self.seconds, self.depth, self.since = seconds, 0, 0.0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @contextmanager
    def guard(self):
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                self.since = time.monotonic()
            if self.thread is None:
                self.thread = threading.Thread(target=self.watch, name="minimlx-rank-watchdog", daemon=True)
                self.thread.start()
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1

    def watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            with self.lock:
                late = self.depth and time.monotonic() - self.since > self.seconds
            if late:
                sys.stderr.write(
                    f"error: a step waited over {self.seconds:g} s for the other ranks: one of them is stopped or "
                    "hung (MINIMLX_RANK_TIMEOUT sets the wait); see that rank, then start every rank again\n"
                )
                sys.stderr.flush()
                os._exit(1)
