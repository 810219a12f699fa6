"""The group of ranks and what each rank's process does besides the model: who speaks, what a lost peer
means, and how much memory its machine has."""

import os
import re
import sys
import warnings
from functools import cache

import mlx.core as mx

from ..errors import InvalidSettingError

LAUNCH = "start every rank with mlx.launch, e.g. mlx.launch -n 2 --backend ring -- minimlx run --pipeline ..."


@cache
def world() -> mx.distributed.Group:
    """The group of processes started together (by `mlx.launch`); InvalidSettingError for a process alone."""
    try:
        return mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise InvalidSettingError(f"this process was not started as one rank of a group ({e}); {LAUNCH}") from None


def rank_zero_speaks() -> None:
    """Only rank 0 writes output, statistics, warnings and errors. On every rank the backend's own C++ messages
    (one per socket when a peer is lost) are silenced: the error that follows says it in one line."""
    quiet = os.open(os.devnull, os.O_WRONLY)
    sys.stderr.flush()
    if world().rank() == 0:
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    else:
        sys.stdout.flush()
        os.dup2(quiet, 1)
        sys.stderr = open(os.devnull, "w")
        warnings.simplefilter("ignore")
    os.dup2(quiet, 2)


def peer_lost(error: RuntimeError) -> str | None:
    """The one-line message for a collective that failed because another rank stopped, else None."""
    if not re.match(r"\[(ring|jaccl|mpi|nccl)\]", str(error)):
        return None
    return (
        f"another rank stopped or its connection broke ({error}); this rank cannot go on alone: "
        "see that rank's output, then start every rank again"
    )


def memory_bytes() -> int:
    """What this machine can hold: the GPU's recommended working set where there is one, else physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        mx.device_info().get("max_recommended_working_set_size", physical)
        if mx.default_device() == mx.gpu
        else physical
    )
