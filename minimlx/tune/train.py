"""What a training step computes: the masked next-token loss, and AdamW on a warm-up + cosine schedule."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim


def differentiable(model: nn.Module) -> nn.Module:
    """`model` with every part computed by MLX's ops, whose gradients exist: on the CPU, loading put in forms that run
    the native kernel, which has none (they are swapped back in place; on other devices nothing changes)."""
    if mx.default_device() == mx.cpu:
        from ..cpu.forms import use_core_forms

        use_core_forms(model)
    return model


def masked_loss(model: nn.Module, ids: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """(mean cross-entropy of the next-token predictions `mask` counts, how many it counts).

    ids: (batch, tokens) int; mask: (batch, tokens), nonzero where token t is a target whose loss counts (its
    prediction comes from the tokens before it, so column 0 never counts; padding and prompt tokens are 0). The
    mean is over all counted tokens of the batch, as transformers' loss over labels with -100 where not counted."""
    logits = model(ids[:, :-1]).astype(mx.float32)
    weights = mask[:, 1:].astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="none")
    tokens = weights.sum()
    return (losses * weights).sum() / mx.maximum(tokens, 1), tokens


def schedule(learning_rate: float, iters: int, warmup: int = 0, end: float = 0.0):
    """The learning rate at each step: linear from 0 over `warmup` steps, then a cosine from `learning_rate` down to
    `end` at step `iters` (mlx.optimizers' schedules)."""
    decay = optim.cosine_decay(learning_rate, max(iters - warmup, 1), end)
    if warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, learning_rate, warmup), decay], [warmup])


def adamw(
    learning_rate: float, iters: int, warmup: int = 0, end: float = 0.0, weight_decay: float = 0.0
) -> optim.AdamW:
    """AdamW as torch computes it (bias-corrected moments) on `schedule`'s rates."""
    return optim.AdamW(
        learning_rate=schedule(learning_rate, iters, warmup, end), weight_decay=weight_decay, bias_correction=True
    )
