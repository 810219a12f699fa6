"""Interventions on one forward pass: switch off attention heads, experts or whole blocks, or patch the stream.

An `Ablation` names what to change; `applied` wraps the parts it touches for the length of one pass and puts
the originals back after, so the model still runs its one loop (and the trace and lens read it as always):

- a head is switched off by zeroing its slice of the attention output before the output projection;
- an expert by giving its router score minus infinity: the router picks each token's next best expert instead;
- a block by dropping what it adds: it still reads the stream (its attention and routing are recorded) but
  its output is its input;
- a patch replaces the stream leaving block `layer` at `position` with another vector, e.g. the state of a
  second prompt there (`patch_from`): activation patching.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidSettingError


@dataclass(frozen=True)
class Patch:
    """Replace the residual stream leaving block `layer` at prompt position `position` by `vector` (dims,)."""

    layer: int
    position: int
    vector: mx.array


@dataclass(frozen=True)
class Ablation:
    """What to switch off: (layer, query head) pairs, (layer, expert) pairs, whole blocks; and patches."""

    heads: tuple[tuple[int, int], ...] = ()
    experts: tuple[tuple[int, int], ...] = ()
    blocks: tuple[int, ...] = ()
    patches: tuple[Patch, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.heads or self.experts or self.blocks or self.patches)

    def check(self, model: nn.Module, tokens: int) -> None:
        """A one-line error for any layer, head, expert or position the model (or a `tokens`-long prompt) lacks."""
        layers = len(model.layers)
        for layer in (*(h[0] for h in self.heads), *(e[0] for e in self.experts), *self.blocks):
            if not 0 <= layer < layers:
                raise InvalidSettingError(f"layer must be between 0 and {layers - 1}, got {layer}")
        for layer, head in self.heads:
            if not model.layers[layer].attn.attends:
                raise InvalidSettingError(
                    f"layer {layer} is a recurrent layer: it has no attention heads to switch off; switch its block "
                    "off instead"
                )
            heads = model.layers[layer].attn.heads
            if not 0 <= head < heads:
                raise InvalidSettingError(f"head must be between 0 and {heads - 1} in layer {layer}, got {head}")
        for layer in {e[0] for e in self.experts}:
            ffn = model.layers[layer].ffn
            if not hasattr(ffn, "route"):
                raise InvalidSettingError(f"layer {layer} has no experts (its FFN is dense)")
            off = {e for lay, e in self.experts if lay == layer}
            if not off <= set(range(ffn.num_experts)):
                raise InvalidSettingError(f"expert must be between 0 and {ffn.num_experts - 1} in layer {layer}")
            if ffn.num_experts - len(off) < ffn.experts_per_token:
                raise InvalidSettingError(
                    f"layer {layer} routes each token to {ffn.experts_per_token} experts; keep at least that many on"
                )
        for patch in self.patches:
            if not 0 <= patch.layer < layers:
                raise InvalidSettingError(f"patch layer must be between 0 and {layers - 1}, got {patch.layer}")
            if not -tokens <= patch.position < tokens:
                raise InvalidSettingError(f"patch position must be within the prompt's {tokens} tokens")


class HeadsOff(nn.Module):
    """The output projection, reading the merged heads with the switched-off ones zeroed."""

    def __init__(self, proj: nn.Module, heads: int, off: set[int]):
        super().__init__()
        self.proj, self.heads = proj, heads
        self.keep = mx.array([0.0 if h in off else 1.0 for h in range(heads)])

    def __call__(self, x: mx.array) -> mx.array:
        split = x.reshape(*x.shape[:-1], self.heads, -1)
        return self.proj((split * self.keep[:, None].astype(x.dtype)).reshape(x.shape))


class ExpertsOff(nn.Module):
    """The router's scoring projection, with minus infinity for the switched-off experts."""

    def __init__(self, proj: nn.Module, num_experts: int, off: set[int]):
        super().__init__()
        self.proj = proj
        self.off = mx.array([e in off for e in range(num_experts)])

    def __call__(self, x: mx.array) -> mx.array:
        return mx.where(self.off, -mx.inf, self.proj(x))


class Intervened(nn.Module):
    """A block whose additions are dropped (`skip`) and/or whose output is patched at some positions."""

    def __init__(self, block: nn.Module, skip: bool, patches: list[Patch]):
        super().__init__()
        self.block, self.skip, self.patches = block, skip, patches

    def __call__(self, x: mx.array, cache=None, recorder=None, positions=None) -> mx.array:
        out = self.block(x, cache, recorder, positions)
        if self.skip:
            out = x
            if recorder is not None:
                recorder(attn_out=mx.zeros_like(x), resid_mid=x, mlp_out=mx.zeros_like(x), resid_post=x)
        for patch in self.patches:
            at = (mx.arange(out.shape[1]) == patch.position % out.shape[1])[:, None]
            out = mx.where(at, patch.vector.astype(out.dtype), out)
        if self.patches and recorder is not None:
            recorder(resid_post=out)
        return out


@contextmanager
def applied(model: nn.Module, ablation: "Ablation | None") -> Iterator[None]:
    """Run the body with `ablation`'s parts wrapped into `model`; the model is restored afterwards."""
    if not ablation:
        yield
        return
    undo = []

    def swap(owner, name, new):
        undo.append((owner, name, owner[name]))
        owner[name] = new

    for layer in sorted({h[0] for h in ablation.heads}):
        attn = model.layers[layer].attn
        swap(attn, "o_proj", HeadsOff(attn.o_proj, attn.heads, {h for lay, h in ablation.heads if lay == layer}))
    for layer in sorted({e[0] for e in ablation.experts}):
        router = model.layers[layer].ffn.router
        off = {e for lay, e in ablation.experts if lay == layer}
        swap(router, "proj", ExpertsOff(router.proj, router.num_experts, off))
    for layer in sorted({*ablation.blocks, *(p.layer for p in ablation.patches)}):
        patches = [p for p in ablation.patches if p.layer == layer]
        swap(model.layers, layer, Intervened(model.layers[layer], layer in ablation.blocks, patches))
    try:
        yield
    finally:
        for owner, name, old in reversed(undo):
            owner[name] = old
