"""A training step computed a stage at a time (`--grad-checkpoint`), each stage evaluated before the next.

The forward pass keeps only the residual stream entering each block; the loss is computed over tiles of the
vocabulary, so the (tokens x vocab) scores never exist whole; the backward pass then runs block by block from the
last, recomputing each block's inside from its kept input. What a step holds beyond the model, its adapter and the
optimizer's state is those inputs plus one block's (or one tile's) activations, however long the step's rows.
The gradients are `masked_loss`'s (the same sums, in another order).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .lora import base_weight
from .train import masked_loss

TILE_BYTES = 1 << 22
"""At most about how many bytes one vocabulary tile's scores (float32, for all of the step's positions) and its
dequantized head rows each hold."""


def stagewise_loss_and_grad(model: nn.Module, ids: mx.array, mask: mx.array) -> tuple[tuple[mx.array, mx.array], dict]:
    """((loss, counted tokens), gradients of the trainable parameters) of `masked_loss(model, ids, mask)`.

    Models whose blocks read more of the pass than the residual stream (`blocks_apart` false: per-layer inputs,
    keys and values shared across layers) are differentiated whole."""
    if not model.blocks_apart:
        return nn.value_and_grad(model, masked_loss)(model, ids, mask)
    weights = mask[:, 1:].astype(mx.float32)
    counted = weights.sum()
    weights = weights / mx.maximum(counted, 1)
    seeds = mx.random.randint(0, 1 << 30, (len(model.layers),)).tolist()  # each block's dropout, drawn again in its
    gradients = {}  # backward pass as in its forward one

    stream, positions = model.embedded(ids[:, :-1])
    streams = [stream]
    mx.eval(stream)
    for layer, seed in zip(model.layers, seeds, strict=True):
        mx.random.seed(seed)
        stream = layer(stream, None, None, positions)
        mx.eval(stream)
        streams.append(stream)

    final = streams.pop()
    head = model.embed if model.tied_head else model.head
    if frozen(head):
        normed = model.norm(final)
        loss, d_normed = tiled_cross_entropy(model, head, normed, ids[:, 1:], weights)
        d_norm, d_stream = stage_backward(model.norm, final)(d_normed)
        gradients |= named("norm", d_norm)
    else:
        loss, head_gradients, d_stream = head_loss_and_grad(model, final, ids[:, 1:], weights)
        gradients |= head_gradients
    mx.eval(loss, d_stream, gradients)
    del final

    for i in reversed(range(len(model.layers))):
        mx.random.seed(seeds[i])
        layer = model.layers[i]
        run = lambda x, layer=layer: layer(x, None, None, positions)  # noqa: E731
        d_layer, d_stream = stage_backward(layer, streams.pop(), run)(d_stream)
        gradients |= named(f"layers.{i}", d_layer)
        mx.eval(d_stream, gradients)

    embedding = [name for name in ("embed", "positions", "layer_inputs") if name in model]
    if any(tree_flatten(model[name].trainable_parameters()) for name in embedding):
        for name, value in embedding_gradients(model, ids[:, :-1], embedding, d_stream).items():
            gradients[name] = gradients[name] + value if name in gradients else value  # a tied head's and the input's
    return (loss, counted), tree_map_with_path(lambda path, _: gradients[path], model.trainable_parameters())


def stagewise_loss(model: nn.Module, ids: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """`masked_loss(model, ids, mask)` (validation's, without gradients) a block at a time and over vocabulary tiles,
    so that it needs no more memory than a training step a stage at a time."""
    head = model.embed if model.tied_head else model.head
    if not model.blocks_apart or not frozen(head):
        return masked_loss(model, ids, mask)
    weights = mask[:, 1:].astype(mx.float32)
    counted = weights.sum()
    stream, positions = model.embedded(ids[:, :-1])
    for layer in model.layers:
        stream = layer(stream, None, None, positions)
        mx.eval(stream)
    normed = model.norm(stream)
    loss, _ = tiled_cross_entropy(model, head, normed, ids[:, 1:], weights / mx.maximum(counted, 1), gradient=False)
    return loss, counted


def frozen(module: nn.Module) -> bool:
    return not tree_flatten(module.trainable_parameters())


def named(prefix: str, tree) -> dict:
    return {f"{prefix}.{name}": value for name, value in tree_flatten(tree)}


def stage_backward(module: nn.Module, x: mx.array, run=None):
    """backward(cotangent) -> (gradients of `module`'s trainable parameters, gradient in x) of `run(x)` (default
    `module(x)`), the stage computed again from its kept input x."""
    run = run or module

    def backward(cotangent: mx.array):
        def surrogate(parameters, x):
            module.update(parameters)
            return (run(x) * cotangent).sum()

        parameters = module.trainable_parameters()
        d_parameters, d_x = mx.grad(surrogate, argnums=(0, 1))(parameters, x)
        module.update(parameters)
        return d_parameters, d_x

    return backward


def embedding_gradients(model: nn.Module, ids: mx.array, names: list[str], d_stream: mx.array) -> dict:
    """The gradients of the embedding stage's trainable parameters (a full fine-tune's, or LoRA on the embedding)."""
    parts = {name: model[name].trainable_parameters() for name in names}

    def surrogate(parameters):
        model.update(parameters)
        return (model.embedded(ids)[0] * d_stream).sum()

    d_parts = mx.grad(surrogate)(parts)
    model.update(parts)
    gradients = {}
    for name in names:
        gradients |= named(name, d_parts[name])
    return gradients


def head_loss_and_grad(model: nn.Module, final: mx.array, targets: mx.array, weights: mx.array):
    """(loss, gradients of the final norm's and head's trainable parameters, d final) for a head that is trained:
    its scores made whole, through the module itself."""
    names = ["norm", "embed" if model.tied_head else "head"]
    parts = {name: model[name].trainable_parameters() for name in names}

    def loss_of(parameters, final):
        model.update(parameters)
        logits = model.unembed(model.norm(final)).astype(mx.float32)
        return (nn.losses.cross_entropy(logits, targets, reduction="none") * weights).sum()

    loss, (d_parts, d_final) = mx.value_and_grad(loss_of, argnums=(0, 1))(parts, final)
    model.update(parts)
    gradients = {}
    for name in names:
        gradients |= named(name, d_parts[name])
    return loss, gradients, d_final


def tiled_cross_entropy(
    model: nn.Module, head: nn.Module, normed: mx.array, targets: mx.array, weights: mx.array, gradient: bool = True
) -> tuple[mx.array, mx.array | None]:
    """(sum of weights x cross-entropy, its gradient in `normed` unless not `gradient`) with a frozen head, a tile of
    vocabulary rows at a time: the first pass keeps each position's running maximum and sum of exponentials
    (log-sum-exp), the second turns each tile's scores into softmax - one-hot and adds its product with the tile's rows
    to the gradient."""
    dims = normed.shape[-1]
    x = normed.reshape(-1, dims).astype(mx.float32)
    targets, weights = targets.reshape(-1), weights.reshape(-1)
    vocab = head.weight.shape[0]
    tile = max(64, TILE_BYTES // (4 * max(x.shape[0], dims)))
    bounds = [(start, min(start + tile, vocab)) for start in range(0, vocab, tile)]

    top = mx.full((x.shape[0],), -mx.inf)
    total, target_score = mx.zeros((x.shape[0],)), mx.zeros((x.shape[0],))
    for start, stop in bounds:
        scores = tile_scores(model, x, head_rows(head, start, stop))
        new_top = mx.maximum(top, scores.max(-1))
        total = total * mx.exp(top - new_top) + mx.exp(scores - new_top[:, None]).sum(-1)
        inside = (targets >= start) & (targets < stop)
        picked = mx.take_along_axis(scores, mx.clip(targets - start, 0, stop - start - 1)[:, None], -1)[:, 0]
        target_score = mx.where(inside, picked, target_score)
        top = new_top
        mx.eval(top, total, target_score)
    log_total = top + mx.log(total)
    loss = (weights * (log_total - target_score)).sum()
    if not gradient:
        return loss, None

    d_x = mx.zeros_like(x)
    for start, stop in bounds:
        rows = head_rows(head, start, stop)
        scores, chain = tile_scores(model, x, rows, with_chain=True)
        d_scores = mx.exp(scores - log_total[:, None])
        hit = targets[:, None] == mx.arange(start, stop)[None]
        d_scores = (d_scores - hit) * weights[:, None] * chain
        d_x = d_x + d_scores @ rows
        mx.eval(d_x)
    return loss, d_x.reshape(normed.shape).astype(normed.dtype)


def tile_scores(model: nn.Module, x: mx.array, rows: mx.array, with_chain: bool = False):
    """The scores of a tile of tokens as `Transformer.unembed` makes them (divided, soft-capped), and with
    `with_chain` the derivative of those scores in the head's raw products."""
    scores, chain = x @ rows.T, 1.0
    if model.logit_divisor is not None:
        scores, chain = scores / model.logit_divisor, 1.0 / model.logit_divisor
    if model.logit_cap is not None:
        capped = mx.tanh(scores / model.logit_cap)
        scores, chain = model.logit_cap * capped, chain * (1 - capped * capped)
    return (scores, chain) if with_chain else scores


def head_rows(head: nn.Module, start: int, stop: int) -> mx.array:
    """Rows start..stop of a frozen head's (or tied embedding's) weight, in float32, dequantized where packed."""
    return base_weight(head, slice(start, stop)).astype(mx.float32)
