"""Named activations of one forward pass through the one loop.

The model runs with a `Recorder`; each block hands over `resid_pre`, `attn_out`, `resid_mid`,
`mlp_out` and `resid_post` (as `layers.{i}.<what>`), the loop adds `embed`, `final_norm` and
`logits`. For MoE layers the routing decision is recomputed from the recorded `resid_mid`
(`layers.{i}.expert_indices` / `expert_weights`), so the production path never does that work.

With `attention=True` each layer also hands over `queries` (batch, heads, tokens, head_dim) and
`keys` (batch, kv_heads, tokens, head_dim), both after RoPE (for latent attention, the per-head
queries and keys rebuilt from the latents), and `attn_weights` (batch, heads, tokens, tokens):
row t is how query token t shares its attention among the tokens it sees (itself and those before
it, or only the last `window` of them in a sliding-window layer). Each row sums to 1, except in
layers with attention sinks, where the sink takes its share and the row sums to 1 minus it.
The weights are formed only while tracing; the fused kernel never forms them. A recurrent layer (whose token-mixer
declares that it does not attend) has none of those; it hands over `state_norm` (batch,), the norm of the state its
pass leaves.
"""

import mlx.core as mx
import mlx.nn as nn

from ..core import Recorder
from ..core.vision import PlacedImages
from ..decode.prompt import check_ids, vocab_size
from ..errors import InvalidSettingError
from .ablation import Ablation, Patch, applied

BLOCK_ACTIVATIONS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
ROUTING = ("expert_indices", "expert_weights")
ATTENTION = ("queries", "keys", "attn_weights")
STATE = "state_norm"  # a recurrent layer's: the norm of the state its pass leaves, (batch,)


def activation_names(model: nn.Module, attention: bool = False) -> list[str]:
    """Every name `trace` can return for `model` (with each layer's attention when `attention`), in the
    order the forward pass produces them."""
    names = ["embed"]
    for i, layer in enumerate(model.layers):
        attends = attention and layer.attn.attends  # a recurrent layer records no attention, but its state's norm
        block = ("resid_pre", *ATTENTION, *BLOCK_ACTIVATIONS[1:]) if attends else BLOCK_ACTIVATIONS
        if not layer.attn.attends:
            block = ("resid_pre", STATE, *BLOCK_ACTIVATIONS[1:])
        names += [f"layers.{i}.{what}" for what in block]
        if hasattr(layer.ffn, "route"):
            names += [f"layers.{i}.{what}" for what in ROUTING]
    return names + ["final_norm", "logits"]


def attention_layers(model: nn.Module) -> list[int]:
    """The layers whose token-mixer attends (`attends`): those with queries, keys and attention weights."""
    return [i for i, layer in enumerate(model.layers) if layer.attn.attends]


def attention_everywhere(model: nn.Module) -> set[str]:
    """The attention names every layer would have if each attended (to tell a recurrent layer's apart)."""
    return {f"layers.{i}.{what}" for i in range(len(model.layers)) for what in ATTENTION}


def _as_batch(model: nn.Module, ids) -> mx.array:
    """(batch, tokens) ids from one sequence or a batch of equally long ones, each id checked against the vocabulary."""
    rows = ids.tolist() if hasattr(ids, "tolist") else list(ids) if hasattr(ids, "__iter__") else ids
    rows = rows if isinstance(rows, list) and rows and isinstance(rows[0], (list, tuple)) else [rows]
    rows = [check_ids(row, vocab_size(model)) for row in rows]
    if len({len(row) for row in rows}) > 1:
        raise InvalidSettingError("the sequences of a batch must be equally long; trace them one at a time")
    return mx.array(rows)


def trace(
    model: nn.Module,
    ids,
    names: list[str] | None = None,
    attention: bool = False,
    ablate: Ablation | None = None,
    images: PlacedImages | None = None,
) -> dict[str, mx.array]:
    """Run `model` on `ids` ((batch,) tokens) and return the activations named in `names` (all when None).

    `attention=True` adds every layer's `queries`, `keys` and `attn_weights` (which `names` can also
    name one by one). The result is evaluated and ordered as `names` (then the attention added), or as
    the forward pass produces them. `ablate` switches heads, experts or blocks off (or patches the
    stream) for this pass: see `minimlx.anatomy.ablation`. `images` (one sequence's, `PlacedImages.at` its ids) put
    an image-text model's soft tokens in place of its image tokens, as generation's first pass does.
    """
    if names is not None:
        unknown = sorted(set(names) - set(activation_names(model, attention=True)))
        recurrent = [n for n in unknown if n.rpartition(".")[2] in ATTENTION and n in attention_everywhere(model)]
        if recurrent:
            layer = recurrent[0].split(".")[1]
            raise InvalidSettingError(
                f"layer {layer} is a recurrent layer ({type(model.layers[int(layer)].attn).__name__}): it has no "
                f"attention to record; pick one of the attention layers {attention_layers(model)}"
            )
        if unknown:
            raise InvalidSettingError(
                f"no activation named {unknown[0]!r}; use embed, "
                f"layers.<i>.<{'|'.join(BLOCK_ACTIVATIONS + ATTENTION + ROUTING + (STATE,))}>, "
                "final_norm or logits (routing only for MoE layers, state_norm for recurrent ones)"
            )
    if names is None:
        names = activation_names(model, attention)
    elif attention:
        attention_names = [n for n in activation_names(model, True) if n.rpartition(".")[2] in ATTENTION]
        names = [*names, *(n for n in attention_names if n not in names)]
    routed = [
        i
        for i, layer in enumerate(model.layers)
        if hasattr(layer.ffn, "route") and any(f"layers.{i}.{w}" in names for w in ROUTING)
    ]
    recorder = Recorder(set(names) | {f"layers.{i}.resid_mid" for i in routed})
    batch = _as_batch(model, ids)
    if images is not None and batch.shape[0] != 1:
        raise InvalidSettingError("images are traced with one sequence at a time")
    if ablate:
        ablate.check(model, batch.shape[1])
    blocks = list(model.layers)  # the blocks themselves, whatever `applied` wraps around them
    with applied(model, ablate):
        model(batch, recorder=recorder, images=images)
        values = recorder.values
        for i in routed:
            indices, weights = blocks[i].ffn.route(blocks[i].ffn_input(values[f"layers.{i}.resid_mid"]))
            values[f"layers.{i}.expert_indices"], values[f"layers.{i}.expert_weights"] = indices, weights
        values = {name: values[name] for name in names}
        mx.eval(values)
    return values


def residual_stream(model: nn.Module, ids, ablate: Ablation | None = None) -> mx.array:
    """The residual stream of one sequence (`ids`: its tokens) after the embedding and after each block.

    Shape (layers + 1, tokens, dims): row 0 is what enters the first block, row i + 1 what leaves block i.
    """
    names = ["embed"] + [f"layers.{i}.resid_post" for i in range(len(model.layers))]
    values = trace(model, ids, names, ablate=ablate)
    return mx.stack([values[name][0] for name in names])


def patch_from(model: nn.Module, ids, layer: int, position: int = -1, target_position: int = -1) -> Patch:
    """A patch that puts the stream of prompt `ids` leaving block `layer` at `position` into another prompt's
    pass at `target_position` (activation patching)."""
    if not 0 <= layer < len(model.layers):
        raise InvalidSettingError(f"patch layer must be between 0 and {len(model.layers) - 1}, got {layer}")
    name = f"layers.{layer}.resid_post"
    state = trace(model, ids, [name])[name][0]
    if not -state.shape[0] <= position < state.shape[0]:
        raise InvalidSettingError(f"position must be within the source prompt's {state.shape[0]} tokens")
    return Patch(layer, target_position, state[position])
