"""Peak-memory measurements of training steps, each run in a fresh process (`in_fresh_process`): MLX's peak counter
is per process, and an engine thread another test left running would add its allocations to the peak measured."""

import multiprocessing

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten


def in_fresh_process(function, *args):
    """`function(*args)` in a new Python process (spawned: nothing of this one's state), its result sent back."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree))


def checkpointing_peaks(config: dict) -> dict:
    """One step of a 4-block model over 2 x 256 tokens without and with per-block checkpointing: {checkpointed:
    (loss, gradients as numpy, peak bytes)}."""
    import minimlx  # noqa: F401  (before the model: its CPU setup)
    from minimlx.archs import build_model
    from minimlx.tune import AdapterSettings, attach, masked_loss

    model = build_model({**config, "num_hidden_layers": 4})
    attach(model, AdapterSettings(rank=4, targets="all-linear"))
    mx.eval(model.parameters())
    ids = mx.random.randint(0, 64, (2, 257), key=mx.random.key(0))
    step = nn.value_and_grad(model, lambda m, ids: masked_loss(m, ids, mx.ones(ids.shape))[0])
    results = {}
    for checkpointed in (False, True):
        model.checkpoint_blocks = checkpointed
        mx.clear_cache()
        mx.reset_peak_memory()
        loss, grads = step(model, ids)
        mx.eval(loss, grads)
        peak = mx.get_peak_memory()
        results[checkpointed] = loss.item(), {k: np.array(g) for k, g in tree_flatten(grads)}, peak
    return results


def qlora_peaks(folder: str, vocab: int) -> tuple[int, int, int]:
    """(peak bytes over 3 QLoRA steps of one 16-token row, bytes held by the model and AdamW's state, bytes of the
    frozen packed weights) for the packed folder `folder`, all-linear rank 8."""
    import minimlx  # noqa: F401
    from minimlx import load_model
    from minimlx.tune import AdapterSettings, adamw, attach, differentiable, masked_loss

    model = differentiable(load_model(folder, dtype="quantized"))
    attach(model, AdapterSettings(rank=8, alpha=16, targets="all-linear"))
    mx.eval(model.parameters())
    optimizer = adamw(1e-4, 10, 2)
    step = nn.value_and_grad(model, lambda m, ids, mask: masked_loss(m, ids, mask)[0])
    rng = np.random.default_rng(0)
    mx.reset_peak_memory()
    for _ in range(3):
        ids = mx.array(rng.integers(0, vocab, (1, 16)))
        loss, grads = step(model, ids, mx.ones(ids.shape))
        optimizer.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), optimizer.state)
        del grads
    peak = mx.get_peak_memory()
    held = nbytes(model.parameters()) + nbytes(optimizer.state)
    return peak, held, nbytes(model.parameters()) - nbytes(model.trainable_parameters())
