"""The one loop every architecture runs: embed (+ positions) -> blocks -> final norm -> head."""

import mlx.core as mx
import mlx.nn as nn

from .attention import soft_cap
from .positions import Positions
from .recorder import Recorder
from .vision import PlacedImages


class Transformer(nn.Module):
    """A decoder-only language model assembled from core parts by an architecture plugin.

    `head=None` ties the output projection to the token embedding (its transpose scores tokens).
    `positions` is a learned position embedding (GPT-2); rotary models leave it None.
    `embed_scale` multiplies the embedded tokens (Gemma: sqrt(dims), rounded to the embedding's dtype as
    transformers does). `logit_cap` soft-caps the logits: cap * tanh(logits / cap); `logit_divisor` divides them.
    `layer_inputs` gives each layer an input of its own from the tokens and their embedding (`PerLayerInputs`), put
    in the pass's `Positions` for the blocks to read. `blocks_apart` declares whether each block reads nothing of the
    pass but the residual stream and its own cache, so that ranks may hold blocks apart (not where a layer attends
    over another's keys and values, or reads an input of its own). `vision` (an `ImageEncoder`) turns images into soft
    tokens (`encode_images`), which a forward pass's `images` place among the embedded tokens.
    """

    config = None  # the architecture plugin's config (its `max_positions` the context), set by `archs.build`
    checkpoint_blocks = False  # training: keep only each block's input and recompute its inside for the gradients
    image_processor = (
        None  # with `vision`: what turns pictures into its `ImageInput`s (`minimlx.vision`), set by `load`
    )

    def __init__(
        self,
        embed: nn.Module,
        layers: list[nn.Module],
        norm: nn.Module,
        head: nn.Module | None = None,
        positions: nn.Module | None = None,
        embed_scale: float | None = None,
        logit_cap: float | None = None,
        logit_divisor: float | None = None,
        layer_inputs: nn.Module | None = None,
        blocks_apart: bool = True,
        vision: nn.Module | None = None,
    ):
        super().__init__()
        self.embed = embed
        if layer_inputs is not None:
            self.layer_inputs = layer_inputs
        if positions is not None:
            self.positions = positions
        self.layers = layers
        self.norm = norm
        if head is not None:
            self.head = head
        if vision is not None:
            self.vision = vision
        self.embed_scale, self.logit_cap, self.logit_divisor = embed_scale, logit_cap, logit_divisor
        self.blocks_apart = blocks_apart

    @property
    def tied_head(self) -> bool:
        return "head" not in self

    def __call__(
        self,
        ids: mx.array,
        cache: list | None = None,
        recorder: Recorder | None = None,
        last_only: bool = False,
        images: PlacedImages | None = None,
    ) -> mx.array:
        """ids: (batch, tokens) -> logits (batch, tokens, vocab), continuing from `cache` if given; with
        `last_only`, (batch, 1, vocab) for the last position only (a prompt's prefill, whose next token is
        sampled from it: the head's product over the other positions is skipped). `images` (one prompt's first
        pass) replace its image tokens' embeddings with soft tokens, each image's seeing each other both ways."""
        x, positions = self.embedded(ids, cache, images)
        if recorder is not None:
            recorder(embed=x)
        for i, layer in enumerate(self.layers):
            layer_cache = cache[i] if cache is not None else None
            scope = recorder.scope(f"layers.{i}.") if recorder is not None else None
            x = self.run_layer(layer, x, layer_cache, scope, positions)
            if images is not None:
                x = images.after_layer(x, i)
        x = self.norm(x)  # over every position: on an earlier pipeline rank this slot sends them all on
        logits = self.unembed(x[:, -1:] if last_only else x)
        if recorder is not None:
            recorder(final_norm=x, logits=logits)
        return logits

    def embedded(
        self, ids: mx.array, cache: list | None = None, images: PlacedImages | None = None
    ) -> tuple[mx.array, Positions]:
        """The residual stream entering the first block, and the pass's positions: the embedded tokens (scaled,
        images placed, learned positions added) and each layer's own input where the model has them."""
        x = self.embed(ids)
        if self.embed_scale is not None:
            x = x * mx.array(self.embed_scale, dtype=x.dtype)
        positions = Positions.of(ids.shape[1], position_cache(cache))
        if images is not None:
            x = images.scatter(x)
            positions.blocks, positions.axes = images.blocks, images.axes
            positions.blocks_windowed_only = images.windowed_only
        if "positions" in self:
            start = positions.offset
            start = start[:, None] if isinstance(start, mx.array) else start  # one start per row when rows are padded
            x = x + self.positions(start + mx.arange(ids.shape[1]))
        if "layer_inputs" in self:  # an image's places read as its stand-in token, and as its soft tokens
            positions.layer_inputs = self.layer_inputs(ids if images is None else images.text_ids(ids), x)
        return x, positions

    def encode_images(self, images) -> mx.array:
        """Images as the image processor prepared them (`ImageInput`s) -> their soft tokens (places, dims)."""
        return self.vision(images)

    def run_layer(self, layer: nn.Module, x: mx.array, cache, recorder: Recorder | None, positions: Positions):
        """One block of the loop (a backend's form of the model may schedule it differently). With
        `checkpoint_blocks`, a pass without cache or recorder (training's) is checkpointed per block: the backward
        pass recomputes the block's activations from its input instead of holding them (`mx.checkpoint`)."""
        if self.checkpoint_blocks and cache is None and recorder is None:
            return checkpointed(layer, x, positions)
        return layer(x, cache, recorder, positions)

    def unembed(self, x: mx.array) -> mx.array:
        """Token scores from final-normed hidden states: the lm_head, or the tied embedding's transpose."""
        logits = self.embed.as_linear(x) if self.tied_head else self.head(x)
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        return logits if self.logit_cap is None else soft_cap(logits, self.logit_cap)

    def make_cache(self) -> list:
        """One cache per layer, of the kind that layer's attention needs."""
        return [layer.attn.make_cache() for layer in self.layers]


def position_cache(cache: list | None):
    """The layer cache that says where the next tokens sit: the first that holds positions (a hybrid model's
    recurrent layers' do not), else the first."""
    if cache is None:
        return None
    return next((c for c in cache if c.holds_positions), cache[0])


def checkpointed(layer: nn.Module, x: mx.array, positions: Positions) -> mx.array:
    """`layer(x)` under `mx.checkpoint`, its trainable parameters passed in so that their gradients flow."""

    def run(parameters, x):
        layer.update(parameters)
        return layer(x, None, None, positions)

    return mx.checkpoint(run)(layer.trainable_parameters(), x)
