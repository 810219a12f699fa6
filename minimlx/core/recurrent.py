"""Recurrent token-mixers: layers that carry a fixed-size state from token to token instead of attending over a
growing cache. A block holds one where it would hold attention; its cache is a `RecurrentCache`.

- `causal_conv`: a short depthwise convolution over the last `kernel` inputs of each channel, with the last
  `kernel - 1` inputs kept as state.
- The gated delta rule: a matrix state S (key features x value features) per head, decayed by exp(g) and then
  corrected toward v along k with strength beta (S <- e^g S + k beta (v - (e^g S)^T k)^T), read by q. It runs in a
  recurrent form (one token at a time: decode steps) and in a chunked form (a chunk's updates condensed into a few
  matrix products: prompts), which compute the same numbers.
- `GatedDeltaNet`: projections, the convolution over q|k|v, l2-normed q and k, the rule, a gated RMSNorm, the output
  projection.
"""

from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from .cache import RecurrentCache
from .positions import Positions
from .recorder import Recorder


def causal_conv(x: mx.array, weight: mx.array, state: mx.array | None, padding: list[int] | None = None):
    """Depthwise causal convolution of x (batch, tokens, channels) with weight (channels, kernel, 1), continuing
    `state` (batch, kernel - 1, channels: the inputs before x; zeros when None). Returns (y, the new state).

    With `padding`, that many leading columns of each row hold no token: each row's state is moved to sit right
    before its first token, so the padding never enters a window or the new state.
    """
    batch, tokens, channels = x.shape
    kept = weight.shape[1] - 1
    if state is None:
        state = mx.zeros((batch, kept, channels), x.dtype)
    joined = mx.concatenate([state.astype(x.dtype), x], axis=1)
    if padding is not None and any(padding):
        j = mx.arange(kept + tokens)[None, :]
        pad = mx.array(padding)[:, None]
        source = mx.where(j < pad + kept, j - pad, j)
        joined = mx.take_along_axis(joined, mx.maximum(source, 0)[..., None], axis=1) * (j >= pad)[..., None]
    # the window's few taps as shifted products: a depthwise conv1d of thousands of channels is far slower on the CPU
    y = sum(joined[:, j : j + tokens] * weight[:, j, 0] for j in range(kept + 1))
    return y, joined[:, joined.shape[1] - kept :]


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x) as plain ops: mlx.nn's is an `mx.compile`d function, whose traces, made on the stream of the
    thread that runs the model (the server's engine thread), would outlive it and abort the process at exit."""
    return x * mx.sigmoid(x)


def softplus(x: mx.array) -> mx.array:
    """log(1 + e^x) as plain ops (see `silu`)."""
    return mx.logaddexp(x, 0.0)


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis."""
    return x * mx.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def gated_delta_recurrent(q, k, v, g, beta, state):
    """The gated delta rule one token at a time. q, k: (batch, heads, tokens, key_dims); v: (..., value_dims);
    g (log decay), beta: (batch, heads, tokens); state: (batch, heads, key_dims, value_dims).
    Returns (outputs (batch, heads, tokens, value_dims), the final state)."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * mx.exp(g[:, :, t])[..., None, None]
        predicted = (state * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    return mx.stack(outputs, axis=2), state


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for a strictly lower-triangular a (..., n, n), by halves: [[T, 0], [C, B]]^-1 is
    [[T^-1, 0], [-B^-1 C T^-1, B^-1]], the two diagonal halves inverted together, log2(n) levels of matrix products
    (so it runs wherever matmul does). Stable where powers of a grow large (keys much alike: an image's), unlike a
    product of (I + (-a)^(2^j)). n is padded to a power of two (the padding's rows and columns zero)."""
    n = a.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        a = mx.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, size - n), (0, size - n)])
    return inverse_by_halves(a)[..., :n, :n]


def inverse_by_halves(a: mx.array) -> mx.array:
    n = a.shape[-1]
    if n == 1:
        return mx.ones_like(a)
    h = n // 2
    top, bottom = inverse_by_halves(mx.stack([a[..., :h, :h], a[..., h:, h:]]))
    corner = -(bottom @ (a[..., h:, :h] @ top))
    upper = mx.concatenate([top, mx.zeros_like(top)], axis=-1)
    return mx.concatenate([upper, mx.concatenate([corner, bottom], axis=-1)], axis=-2)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The gated delta rule over chunks of `chunk` tokens; arguments and results as `gated_delta_recurrent`.

    Within a chunk with cumulative log decay G, the corrections the rule writes solve a unit lower-triangular system
    (I + A) u = beta v with A_ij = beta_i (k_i . k_j) e^(G_i - G_j), j < i; the chunk's outputs are its queries' read
    of the state it starts from plus their causal, decayed attention over those corrections.
    """
    batch, heads, tokens, key_dims = k.shape
    value_dims = v.shape[-1]
    size = min(chunk, tokens)
    padded = -tokens % size
    if padded:  # zero k, beta and g: the padding neither reads, writes nor decays the state
        q, k, v = (mx.pad(a, [(0, 0), (0, 0), (0, padded), (0, 0)]) for a in (q, k, v))
        g, beta = (mx.pad(a, [(0, 0), (0, 0), (0, padded)]) for a in (g, beta))
    chunks = q.shape[2] // size
    q, k, v = (a.reshape(batch, heads, chunks, size, -1) for a in (q, k, v))
    g, beta = (a.reshape(batch, heads, chunks, size) for a in (g, beta))
    cumulative = mx.cumsum(g, axis=-1)
    rows, cols = mx.arange(size)[:, None], mx.arange(size)[None, :]
    gaps = cumulative[..., :, None] - cumulative[..., None, :]
    decay = mx.exp(mx.where(cols <= rows, gaps, -mx.inf))  # e^(G_i - G_j) for j <= i, else 0
    k_beta = k * beta[..., None]
    a = mx.where(cols < rows, (k_beta @ k.swapaxes(-1, -2)) * decay, 0)
    inverse = unit_lower_inverse(a)
    corrections = inverse @ (v * beta[..., None])
    state_keys = inverse @ (k_beta * mx.exp(cumulative)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = q * mx.exp(cumulative)[..., None]
    k_decayed = k * mx.exp(cumulative[..., -1:] - cumulative)[..., None]
    chunk_decay = mx.exp(cumulative[..., -1])[..., None, None]
    outputs = []
    for i in range(chunks):
        new = corrections[:, :, i] - state_keys[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ new
    out = mx.stack(outputs, axis=2).reshape(batch, heads, chunks * size, value_dims)
    return out[:, :, :tokens], state


def decayed_scan_recurrent(q, k, v, g, state):
    """Linear attention with a decaying state, one token at a time: S <- e^g S + k v^T, out = S^T q.
    q, k: (batch, heads, tokens, key_dims); v: (..., value_dims); g: (batch, heads, tokens); state: (batch, heads,
    key_dims, value_dims). Returns (outputs (batch, heads, tokens, value_dims), the final state)."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * mx.exp(g[:, :, t])[..., None, None] + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(-2))
    return mx.stack(outputs, axis=2), state


def decayed_scan_chunked(q, k, v, g, state, chunk: int = 64):
    """`decayed_scan_recurrent` over chunks of `chunk` tokens: each chunk's outputs are its queries' read of the
    state it starts from plus their causal attention over its own keys, decayed by e^(G_i - G_j)."""
    batch, heads, tokens, _ = k.shape
    size = min(chunk, tokens)
    padded = -tokens % size
    if padded:  # zero keys and no decay: the padding leaves the state as it is
        q, k, v = (mx.pad(a, [(0, 0), (0, 0), (0, padded), (0, 0)]) for a in (q, k, v))
        g = mx.pad(g, [(0, 0), (0, 0), (0, padded)])
    chunks = q.shape[2] // size
    q, k, v = (a.reshape(batch, heads, chunks, size, -1) for a in (q, k, v))
    cumulative = mx.cumsum(g.reshape(batch, heads, chunks, size), axis=-1)
    rows, cols = mx.arange(size)[:, None], mx.arange(size)[None, :]
    gaps = cumulative[..., :, None] - cumulative[..., None, :]
    intra = (q @ k.swapaxes(-1, -2)) * mx.exp(mx.where(cols <= rows, gaps, -mx.inf))
    q_decayed = q * mx.exp(cumulative)[..., None]
    k_decayed = k * mx.exp(cumulative[..., -1:] - cumulative)[..., None]
    chunk_decay = mx.exp(cumulative[..., -1])[..., None, None]
    outputs = []
    for i in range(chunks):
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v[:, :, i])
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].swapaxes(-1, -2) @ v[:, :, i]
    out = mx.stack(outputs, axis=2).reshape(batch, heads, chunks * size, -1)
    return out[:, :, :tokens], state


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate): a head's output normed, then opened or shut per feature by a gate.

    With `gate_first`, rms_norm(x * silu(gate)) * weight instead, normed over `groups` equal slices of the features.
    """

    def __init__(self, dims: int, eps: float = 1e-6, gate_first: bool = False, groups: int = 1):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps, self.gate_first, self.groups = eps, gate_first, groups

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        gate = self.opening(gate.astype(mx.float32))
        if not self.gate_first:
            return mx.fast.rms_norm(x, self.weight, self.eps) * gate.astype(x.dtype)
        gated = (x.astype(mx.float32) * gate).reshape(*x.shape[:-1], self.groups, -1)
        normed = mx.fast.rms_norm(gated, None, self.eps).reshape(x.shape).astype(x.dtype)
        return self.weight * normed

    def opening(self, gate: mx.array) -> mx.array:
        """silu(gate): how far each feature is let through."""
        return silu(gate)


class CausalConv(nn.Module):
    """The weight of a depthwise causal convolution: (channels, kernel, 1), as MLX's conv1d reads it."""

    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((channels, kernel, 1))
        if bias:
            self.bias = mx.zeros((channels,))

    def __call__(self, x: mx.array, state: mx.array | None, padding: list[int] | None = None):
        y, state = causal_conv(x, self.weight, state, padding)
        return (y + self.bias if "bias" in self else y), state


def spread_heads(a: mx.array, count: int, dims: int, heads: int) -> mx.array:
    """(batch, tokens, count * dims) -> (batch, heads, tokens, dims) in float32, each of the `count` heads serving
    heads / count consecutive ones."""
    batch, tokens, _ = a.shape
    a = a.reshape(batch, tokens, count, dims).astype(mx.float32)
    return (mx.repeat(a, heads // count, axis=2) if count != heads else a).transpose(0, 2, 1, 3)


class RecurrentLayer(nn.Module):
    """What the recurrent token-mixers share: called as attention is, a `RecurrentCache` per layer, a causal
    convolution (`conv1d`) that continues the cache's and skips a padded pass's padding, and the state a pass
    starts from."""

    attends: ClassVar[bool] = False
    """No attention weights, no heads to switch off (`Attention.attends`): a trace records what the layer adds."""

    def __call__(
        self,
        x: mx.array,
        cache: RecurrentCache | None = None,
        recorder: Recorder | None = None,
        positions: Positions | None = None,
    ) -> mx.array:
        """`mix` over `cache`; a `recorder` that wants it gets `state_norm` (batch,): the norm of the state the pass
        leaves (the recurrent state, or the convolution's where that is all there is)."""
        if recorder is None or not recorder.wants("state_norm"):
            return self.mix(x, cache)
        held = cache if cache is not None else self.make_cache()
        out = self.mix(x, held)
        state = held.state[-1].astype(mx.float32)
        recorder(state_norm=mx.sqrt((state * state).reshape(state.shape[0], -1).sum(-1)))
        return out

    def mix(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        raise NotImplementedError

    def convolve(self, x: mx.array, cache: RecurrentCache | None) -> tuple[mx.array, mx.array, mx.array | None]:
        """(conv1d over x continuing the cache, the new conv state, which columns hold tokens: None when all)."""
        valid = cache.valid(x.shape[1]) if cache is not None else None
        padding = cache.row_padding() if valid is not None else None
        y, state = self.conv1d(x, cache.conv if cache is not None else None, padding)
        return y, state, valid

    @staticmethod
    def start_state(cache: RecurrentCache | None, shape: tuple) -> mx.array:
        """The recurrent state a pass continues: the cache's, or zeros of `shape`."""
        if cache is not None and cache.recurrent is not None:
            return cache.recurrent
        return mx.zeros(shape, mx.float32)

    def make_cache(self) -> RecurrentCache:
        return RecurrentCache()


class GatedDeltaNet(RecurrentLayer):
    """Linear attention by the gated delta rule (Gated DeltaNet).

    x -> q|k|v (a short causal convolution, then silu), z (the output gate), b and a (per value head);
    q, k l2-normed, q over sqrt(key_dims); each key head serves `value_heads // key_heads` consecutive value heads;
    decay g = -exp(A_log) * softplus(a + dt_bias), strength beta = sigmoid(b); the rule's outputs go through a
    gated RMSNorm with z, then the output projection. Prompts run the chunked form, single tokens the recurrent one.
    """

    def __init__(
        self, dims: int, key_heads: int, value_heads: int, key_dims: int, value_dims: int, kernel: int, eps: float
    ):
        super().__init__()
        self.key_heads, self.value_heads, self.key_dims, self.value_dims = key_heads, value_heads, key_dims, value_dims
        key_width, value_width = key_heads * key_dims, value_heads * value_dims
        self.in_proj_qkv = nn.Linear(dims, 2 * key_width + value_width, bias=False)
        self.in_proj_z = nn.Linear(dims, value_width, bias=False)
        self.in_proj_b = nn.Linear(dims, value_heads, bias=False)
        self.in_proj_a = nn.Linear(dims, value_heads, bias=False)
        self.conv1d = CausalConv(2 * key_width + value_width, kernel)
        self.dt_bias = mx.ones((value_heads,))
        self.A_log = mx.zeros((value_heads,))
        self.norm = GatedRMSNorm(value_dims, eps)
        self.out_proj = nn.Linear(value_width, dims, bias=False)
        self.chunk = 64

    def mix(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        batch, tokens, _ = x.shape
        qkv, conv_state, valid = self.convolve(self.in_proj_qkv(x), cache)
        key_width = self.key_heads * self.key_dims
        q, k, v = mx.split(self.activate(qkv), [key_width, 2 * key_width], axis=-1)
        q = l2_normalize(spread_heads(q, self.key_heads, self.key_dims, self.value_heads)) * self.key_dims**-0.5
        k = l2_normalize(spread_heads(k, self.key_heads, self.key_dims, self.value_heads))
        v = spread_heads(v, self.value_heads, self.value_dims, self.value_heads)
        a = self.in_proj_a(x).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * softplus(a)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))
        if valid is not None:  # padding leaves the state as it was: no decay, no write
            g, beta = mx.where(valid[..., None], g, 0), mx.where(valid[..., None], beta, 0)
        g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)
        state = self.start_state(cache, (batch, self.value_heads, self.key_dims, self.value_dims))
        rule = gated_delta_recurrent if tokens == 1 else gated_delta_chunked
        out, state = rule(q, k, v, g, beta, state) if tokens == 1 else rule(q, k, v, g, beta, state, self.chunk)
        if cache is not None:
            cache.update(conv_state, state, tokens)
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)
        z = self.in_proj_z(x).reshape(batch, tokens, self.value_heads, self.value_dims)
        out = self.norm(out, z).reshape(batch, tokens, -1)
        return self.out_proj(out)

    def activate(self, qkv: mx.array) -> mx.array:
        """silu of the convolution's output."""
        return silu(qkv)


class GatedShortConv(RecurrentLayer):
    """A gated short convolution: x -> b, c, h (in_proj); out_proj(c * causal_conv(b * h)). Its only state is the
    convolution's last inputs."""

    def __init__(self, dims: int, kernel: int, bias: bool = False):
        super().__init__()
        self.in_proj = nn.Linear(dims, 3 * dims, bias=bias)
        self.conv1d = CausalConv(dims, kernel, bias)
        self.out_proj = nn.Linear(dims, dims, bias=bias)

    def mix(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        b, c, h = mx.split(self.in_proj(x), 3, axis=-1)
        y, state, _ = self.convolve(b * h, cache)
        if cache is not None:
            cache.update(state, None, x.shape[1])
        return self.out_proj(c * y)


class SelectiveStateSpace(RecurrentLayer):
    """Mamba2's selective state-space layer.

    x -> z (the output gate), x|B|C (a short causal convolution, then silu), dt (per head). Per head, the state
    (state_dims x head_dims) decays by exp(dt * A), A = -exp(A_log), and takes in dt * x B^T; the output reads it
    with C and adds D * x: a decayed linear attention with C as queries, B as keys (each of `groups` shared by
    heads / groups consecutive heads) and dt * x as values. dt = softplus(dt + dt_bias), clipped to `dt_limits`.
    The output goes through a gated RMSNorm (gate first, per group), then the output projection.
    """

    def __init__(
        self,
        dims: int,
        heads: int,
        head_dims: int,
        state_dims: int,
        groups: int,
        kernel: int,
        eps: float,
        conv_bias: bool = True,
        bias: bool = False,
        dt_limits: tuple[float, float] = (0.0, float("inf")),
    ):
        super().__init__()
        self.heads, self.head_dims, self.state_dims, self.groups = heads, head_dims, state_dims, groups
        inner = heads * head_dims
        conv_width = inner + 2 * groups * state_dims
        self.in_proj = nn.Linear(dims, inner + conv_width + heads, bias=bias)
        self.conv1d = CausalConv(conv_width, kernel, conv_bias)
        self.dt_bias = mx.ones((heads,))
        self.A_log = mx.zeros((heads,))
        self.D = mx.ones((heads,))
        self.norm = GatedRMSNorm(inner, eps, gate_first=True, groups=groups)
        self.out_proj = nn.Linear(inner, dims, bias=bias)
        self.dt_limits = dt_limits
        self.chunk = 64

    def mix(self, x: mx.array, cache: RecurrentCache | None) -> mx.array:
        batch, tokens, _ = x.shape
        inner, width = self.heads * self.head_dims, self.groups * self.state_dims
        z, xbc, dt = mx.split(self.in_proj(x), [inner, 2 * inner + 2 * width], axis=-1)
        xbc, conv_state, valid = self.convolve(xbc, cache)
        h, b, c = mx.split(silu(xbc), [inner, inner + width], axis=-1)
        dt = mx.clip(softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32)), *self.dt_limits)
        if valid is not None:  # padding leaves the state as it was: no decay, nothing taken in
            dt = mx.where(valid[..., None], dt, 0)
        values = spread_heads(h, self.heads, self.head_dims, self.heads)
        g = (dt * -mx.exp(self.A_log.astype(mx.float32))).transpose(0, 2, 1)
        q, k = (spread_heads(a, self.groups, self.state_dims, self.heads) for a in (c, b))
        state = self.start_state(cache, (batch, self.heads, self.state_dims, self.head_dims))
        inputs = (q, k, values * dt.transpose(0, 2, 1)[..., None], g, state)
        out, state = decayed_scan_recurrent(*inputs) if tokens == 1 else decayed_scan_chunked(*inputs, self.chunk)
        if cache is not None:
            cache.update(conv_state, state, tokens)
        out = out + values * self.D.astype(mx.float32)[:, None, None]
        out = out.transpose(0, 2, 1, 3).reshape(batch, tokens, inner).astype(x.dtype)
        return self.out_proj(self.norm(out, z))
