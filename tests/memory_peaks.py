"""Memory measurements (training steps' peaks, a conversation's growth), each run in a fresh process
(`in_fresh_process`): MLX's counters are per process, and an engine thread another test left running would add its
allocations to what is measured."""

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
    """One step of a 4-block model over 2 x 256 tokens differentiated whole and a stage at a time (`--grad-checkpoint`):
    {stagewise: (loss, gradients as numpy, peak bytes)}."""
    import minimlx  # noqa: F401  (before the model: its CPU setup)
    from minimlx.archs import build_model
    from minimlx.tune import AdapterSettings, attach, masked_loss
    from minimlx.tune.stages import stagewise_loss_and_grad

    model = build_model({**config, "num_hidden_layers": 4})
    attach(model, AdapterSettings(rank=4, targets="all-linear"))
    mx.eval(model.parameters())
    ids = mx.random.randint(0, 64, (2, 257), key=mx.random.key(0))
    whole = nn.value_and_grad(model, masked_loss)
    results = {}
    for stagewise in (False, True):
        mx.clear_cache()
        mx.reset_peak_memory()
        (loss, _), grads = (stagewise_loss_and_grad if stagewise else whole)(model, ids, mx.ones(ids.shape))
        mx.eval(loss, grads)
        peak = mx.get_peak_memory()
        results[stagewise] = loss.item(), {k: np.array(g) for k, g in tree_flatten(grads)}, peak
    return results


def qlora_peaks(folder: str, vocab: int, rows: int, tokens: int) -> tuple[int, int, int]:
    """(peak bytes over 3 QLoRA steps of `rows` x `tokens` tokens, a stage at a time as `--grad-checkpoint` trains,
    bytes held by the model and AdamW's state, bytes of the frozen packed weights) for the packed folder `folder`,
    all-linear rank 8."""
    import minimlx  # noqa: F401
    from minimlx import load_model
    from minimlx.tune import AdapterSettings, adamw, attach, differentiable
    from minimlx.tune.stages import stagewise_loss_and_grad

    model = differentiable(load_model(folder, dtype="quantized"))
    attach(model, AdapterSettings(rank=8, alpha=16, targets="all-linear"))
    mx.eval(model.parameters())
    optimizer = adamw(1e-4, 10, 2)
    rng = np.random.default_rng(0)
    mx.reset_peak_memory()
    for _ in range(3):
        ids = mx.array(rng.integers(0, vocab, (rows, tokens + 1)))
        (loss, _), grads = stagewise_loss_and_grad(model, ids, mx.ones(ids.shape))
        optimizer.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), optimizer.state)
        del grads
    peak = mx.get_peak_memory()
    held = nbytes(model.parameters()) + nbytes(optimizer.state)
    return peak, held, nbytes(model.parameters()) - nbytes(model.trainable_parameters())


def conversation_memory(folder: str) -> tuple[int, ...]:
    """MLX memory in use, less the conversation's cache, after 10 and after 100 turns of a `Conversation` with the
    chat model in `folder`; then after 20 and after 200 calls of `generate`."""
    import minimlx
    from minimlx.decode import Conversation

    model, tokenizer = minimlx.load(folder, dtype="float32")
    conversation = Conversation(model, tokenizer)

    def held() -> int:
        return mx.get_active_memory() - sum(c.nbytes for c in conversation.cache)

    marks = []
    for turn in range(100):
        list(conversation.say(f"w{turn % 100 + 2} w5", max_tokens=4))
        if turn in (9, 99):
            marks.append(held())
    for run in range(200):
        minimlx.generate(model, tokenizer, "w3 w4", max_tokens=4)
        if run in (19, 199):
            marks.append(mx.get_active_memory())
    return tuple(marks)
