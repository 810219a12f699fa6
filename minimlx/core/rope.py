"""Rotary position embedding: rotate pairs of query/key features by position-dependent angles.

Pair i of a head turns by `position * inv_freq[i]` with `inv_freq[i] = base ** (-2i / dims)`.
Scalings change `inv_freq` (and, for yarn, the size of the result) to stretch the context:

- `linear`: every frequency divided by `factor`.
- `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between.
- `yarn`: the same idea with a linear ramp over rotation counts, plus an attention temperature.
- `per_frequency`: each pair's frequency divided by its own factor from `factors` (how GGUF files
  carry llama3 scaling: the factors llama3's rule gives, precomputed).

`traditional=True` rotates adjacent pairs (x0, x1), (x2, x3)... (the layout GGUF files use);
the default rotates the two halves of the head against each other (Hugging Face's rotate-half).
"""

import math

import mlx.core as mx
import mlx.nn as nn

from .positions import Positions


def llama3_inv_freq(inv_freq: mx.array, scaling: dict, max_positions: int) -> mx.array:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    scaled = mx.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return mx.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """Yarn's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dims: int, base: float, scaling: dict, max_positions: int) -> tuple[mx.array, float]:
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_positions
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv_freq = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, attention_factor


class RoPE(nn.Module):
    """Rotates the first `dims` features of each head; `scaling` is a Hugging Face `rope_scaling` dict."""

    def __init__(
        self,
        dims: int,
        base: float = 10000.0,
        scaling: dict | None = None,
        max_positions: int = 2048,
        traditional: bool = False,
    ):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.output_scale = 1.0
        kind = (scaling or {}).get("rope_type", "default")
        inv_freq = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling, max_positions)
        elif kind == "per_frequency":
            inv_freq = inv_freq / mx.array(scaling["factors"], dtype=mx.float32)
        elif kind == "proportional":  # the first `partial_rotary_factor` of the frequencies turn, the rest stand still
            turning = int(scaling.get("partial_rotary_factor", 1.0) * dims // 2)
            inv_freq = mx.where(mx.arange(dims // 2) < turning, inv_freq, 0.0) / scaling.get("factor", 1.0)
        elif kind == "yarn":
            inv_freq, self.output_scale = _yarn_inv_freq(dims, base, scaling, max_positions)
        elif kind != "default":
            raise ValueError(
                f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, yarn, per_frequency, "
                "proportional"
            )
        self._wavelengths = 1.0 / inv_freq
        self.settings = (dims, base, repr(scaling), max_positions)  # what the wavelengths are made of

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """x: (batch, heads, tokens, head_dim), tokens starting at position `offset`."""
        return self.rotate(x, Positions(x.shape[2], offset))

    def rotate(self, x: mx.array, positions: Positions) -> mx.array:
        """x: (batch, heads, tokens, head_dim) at `positions` (the forward pass's, shared by its layers)."""
        y = mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=positions.offset,
            freqs=self._wavelengths,
        )
        return y * self.output_scale if self.output_scale != 1.0 else y

    def angles(self, offset: int | mx.array, tokens: int) -> tuple[mx.array, mx.array]:
        """cos and sin of the angles of `tokens` positions from `offset`: (dims / 2,) for one token, (tokens, dims / 2),
        or (batch, tokens, dims / 2) for a position per row."""
        start = offset if isinstance(offset, mx.array) else mx.array([offset])
        if start.size > 1:  # a position per batch row
            angles = (start[:, None] + mx.arange(tokens)).astype(mx.float32)[..., None] / self._wavelengths
        elif tokens == 1:
            angles = start.astype(mx.float32) / self._wavelengths
        else:
            angles = (start + mx.arange(tokens)).astype(mx.float32)[:, None] / self._wavelengths
        return mx.cos(angles), mx.sin(angles)


class MultimodalRoPE(RoPE):
    """Qwen's multimodal RoPE: each position has three axes (time, row, column) and `sections` (frequency counts)
    say which axis turns which frequencies: in order (Qwen2-VL, Qwen2.5-VL: the first `sections[0]` by time, the next
    by row, the rest by column), or `interleaved` (Qwen3-VL, Qwen3.5: frequency 3j + 1 by row while j < sections[1],
    3j + 2 by column while j < sections[2], the others by time). A text token sits at the same position along every
    axis, so it turns as under `RoPE`; an image's tokens sit on their grid, given by the pass's `axes` (3, tokens)."""

    def __init__(
        self, dims: int, base: float, sections: tuple[int, ...], max_positions: int = 2048, interleaved: bool = False
    ):
        super().__init__(dims, base, None, max_positions)
        if sum(sections) != dims // 2:
            raise ValueError(f"mrope_section {list(sections)} must add up to half the rotated width ({dims // 2})")
        self._axis_of = mx.array(frequency_axes(sections, interleaved))
        self.settings = (*self.settings, tuple(sections), interleaved)

    def rotate(self, x: mx.array, positions: Positions) -> mx.array:
        if positions.axes is None:
            return super().rotate(x, positions)
        # (3, tokens) -> (tokens, dims / 2): each frequency at its own axis's position
        at = positions.axes[self._axis_of].astype(mx.float32).T
        angles = at / self._wavelengths
        cos, sin = mx.cos(angles), mx.sin(angles)
        half = self.dims // 2
        x1, x2 = x[..., :half].astype(mx.float32), x[..., half : self.dims].astype(mx.float32)
        turned = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
        return turned if self.dims == x.shape[-1] else mx.concatenate([turned, x[..., self.dims :]], axis=-1)


def frequency_axes(sections: tuple[int, ...], interleaved: bool) -> list[int]:
    """The axis (0 time, 1 row, 2 column) whose position turns each of the `sum(sections)` frequencies."""
    if not interleaved:
        return sum(([i % 3] * n for i, n in enumerate(sections)), [])
    axes = [0] * sum(sections)
    for axis in (1, 2):
        for j in range(axis, min(3 * sections[axis], len(axes)), 3):
            axes[j] = axis
    return axes
