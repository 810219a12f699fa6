"""Core parts checked one by one against the formulas they compute, written out in numpy.

Sliding-window attention and its rotating cache (exact prefill in chunks longer than the window, token by
token decoding, memory that stays at the window, batching), attention sinks, soft-capped scores and logits,
the (1 + w) RMSNorm, the gated FFN's activation, the four-norm block and embedding scaling.
"""

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

from minimlx.core import (
    Attention,
    FourNormBlock,
    GatedFFN,
    KVCache,
    OffsetRMSNorm,
    Positions,
    Recorder,
    RMSNorm,
    RoPE,
    RotatingKVCache,
    Transformer,
    soft_cap,
)
from minimlx.cpu.forms import use_cpu_forms

DIMS, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 4, 2, 8, 5


def randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter drawn from N(0, 0.3^2) (norm weights and sinks included, so they matter)."""
    mx.random.seed(seed)
    module.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, module.parameters()))
    return module


def attention(**options) -> Attention:
    return randomized(Attention(DIMS, HEADS, KV_HEADS, HEAD_DIM, RoPE(HEAD_DIM), **options))


def numpy_attention(layer: Attention, x: mx.array) -> np.ndarray:
    """The layer's output recomputed in numpy from its own projections: scores * scale, soft-capped, with
    query t seeing keys t-window+1..t, a sink column per head, softmax, values, output projection."""
    batch, tokens, _ = x.shape

    def heads(t, count):
        return t.reshape(batch, tokens, count, HEAD_DIM).transpose(0, 2, 1, 3)

    q, k = layer.rope(heads(layer.q_proj(x), HEADS)), layer.rope(heads(layer.k_proj(x), KV_HEADS))
    q, k, v = np.array(q), np.array(k), np.array(heads(layer.v_proj(x), KV_HEADS))
    group = HEADS // KV_HEADS
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * layer.scale
    if layer.logit_cap is not None:
        scores = layer.logit_cap * np.tanh(scores / layer.logit_cap)
    t = np.arange(tokens)
    seen = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - (layer.window or tokens + 1))
    scores = np.where(seen, scores, -np.inf)
    if "sinks" in layer:
        sink = np.broadcast_to(np.array(layer.sinks)[None, :, None, None], (*scores.shape[:-1], 1))
        scores = np.concatenate([sink, scores], axis=-1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights = (weights / weights.sum(-1, keepdims=True))[..., -tokens:]
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, -1)
    return np.array(layer.o_proj(mx.array(out.astype(np.float32))))


def through_cache(layer: Attention, x: mx.array, chunks: list[int]) -> tuple[np.ndarray, list[int]]:
    """The layer run over `x` in chunks of the given sizes through its own cache: outputs, and nbytes after each."""
    cache, outputs, sizes, start = layer.make_cache(), [], [], 0
    for size in chunks:
        outputs.append(layer(x[:, start : start + size], cache))
        mx.eval(outputs[-1], cache.state)
        sizes.append(cache.nbytes)
        start += size
    return np.array(mx.concatenate(outputs, axis=1)), sizes


def inputs(tokens: int = 20, batch: int = 2, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(batch, tokens, DIMS)).astype(np.float32))


@pytest.mark.parametrize(
    "options",
    [
        dict(window=WINDOW),
        dict(sinks=True),
        dict(window=WINDOW, sinks=True),
        dict(logit_cap=2.0),
        dict(window=WINDOW, logit_cap=2.0, sinks=True),
    ],
)
def test_attention_matches_its_formula(options):
    layer, x = attention(**options), inputs()
    np.testing.assert_allclose(np.array(layer(x)), numpy_attention(layer, x), atol=2e-5)


@pytest.mark.parametrize("chunks", [[20], [7, 7, 6], [3] + [1] * 17, [12, 1, 1, 6]])
def test_a_sliding_window_through_its_cache_is_exact(chunks):
    """Prefill chunks longer than the window, shorter, and single tokens all give the full-sequence output."""
    layer, x = attention(window=WINDOW, sinks=True), inputs()
    out, _ = through_cache(layer, x, chunks)
    np.testing.assert_allclose(out, numpy_attention(layer, x), atol=2e-5)


def test_the_rotating_cache_holds_the_window_however_long_the_text():
    """nbytes is the window's exactly after every step; the process's MLX memory stops growing with it (a growing
    cache would add 256 bytes a token, 12,800 over these 50)."""
    layer, x = attention(window=WINDOW), inputs(tokens=60)
    _, sizes = through_cache(layer, x, [8] + [1] * 52)
    per_token = 2 * 2 * KV_HEADS * HEAD_DIM * 4  # keys and values, 2 rows, float32
    assert isinstance(layer.make_cache(), RotatingKVCache)
    assert sizes == [(WINDOW - 1) * per_token] * 53
    gc.collect()
    cache, memory = layer.make_cache(), []
    for t in range(60):
        out = layer(x[:, t : t + 1], cache)
        mx.eval(out, cache.state)
        memory.append(mx.get_active_memory())
    # process-wide memory jitters by a few hundred bytes from step to step (buffers of other arrays); a cache
    # that grew would add 40 * 256 = 10,240 bytes between these medians
    early, late = np.median(memory[10:20]), np.median(memory[50:])
    assert late - early <= 2 * per_token


def test_rotating_cache_trim_and_prefix_refuse_what_it_dropped():
    cache = RotatingKVCache(4)
    cache.update(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    assert cache.keeps(1) and cache.trim(2) == 2 and cache.offset == 1 and cache.held == 1
    cache.update(mx.ones((1, 1, 6, 2)), mx.ones((1, 1, 6, 2)))
    assert cache.offset == 7 and cache.held == 3
    assert cache.keeps(7) and cache.keeps(0) and not cache.keeps(5)
    assert cache.prefix(7).held == 3
    with pytest.raises(ValueError, match="no longer holds the first 5"):
        cache.trim(2)
    assert cache.trim(7) == 7 and cache.offset == 0 and cache.nbytes == 0


def test_windowed_rows_of_different_lengths_batch_exactly():
    """Two sequences prefilled alone (one past the window, one not), merged, decoded together, then split:
    each row gets what it gets alone, and the rows' padding stays hidden."""
    layer, x = attention(window=WINDOW, sinks=True), inputs(tokens=14)
    lengths, steps = [9, 3], 4
    alone = [through_cache(layer, x[i : i + 1, : n + steps], [n] + [1] * steps)[0] for i, n in enumerate(lengths)]
    caches = []
    for i, n in enumerate(lengths):
        caches.append(layer.make_cache())
        layer(x[i : i + 1, :n], caches[-1])
    batch = RotatingKVCache.merge(caches)
    assert batch.offset == 9 and batch.padding == [0, 6] and batch.position.tolist() == [9, 3]
    outputs = []
    for t in range(steps):
        step = mx.concatenate([x[i : i + 1, n + t : n + t + 1] for i, n in enumerate(lengths)])
        outputs.append(layer(step, batch))
    together = np.array(mx.concatenate(outputs, axis=1))
    for row in range(2):
        np.testing.assert_allclose(together[row], alone[row][0, lengths[row] :], atol=2e-5)
    short = batch.select([1])
    assert short.offset == 7 and short.padding == [0] and short.held == WINDOW - 1


def test_a_windowed_cache_and_a_growing_one_differ_only_past_the_window():
    plain, windowed = attention(), attention(window=WINDOW)
    assert isinstance(plain.make_cache(), KVCache) and not isinstance(plain.make_cache(), RotatingKVCache)
    x = inputs(tokens=WINDOW)
    np.testing.assert_allclose(np.array(plain(x)), np.array(windowed(x)), atol=1e-6)
    x = inputs(tokens=WINDOW + 1)
    assert not np.allclose(np.array(plain(x))[:, -1], np.array(windowed(x))[:, -1], atol=1e-3)


def test_soft_cap_squashes_into_the_cap():
    x = mx.array([-1000.0, -1.0, 0.0, 0.01, 1000.0])
    np.testing.assert_allclose(np.array(soft_cap(x, 30.0)), 30 * np.tanh(np.array(x) / 30), rtol=1e-6)
    assert abs(soft_cap(x, 30.0)[3].item() - 0.01) < 1e-7 and soft_cap(x, 30.0)[4].item() == pytest.approx(30.0)


def test_offset_rms_norm_scales_by_one_plus_its_weight():
    norm = randomized(OffsetRMSNorm(DIMS, eps=1e-6))
    x = np.array(inputs())
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * (1 + np.array(norm.weight))
    np.testing.assert_allclose(np.array(norm(mx.array(x))), expected, rtol=1e-5, atol=1e-6)
    assert OffsetRMSNorm(4).weight.tolist() == [0.0] * 4  # zeros: no rescaling


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_ffn_applies_its_activation_to_the_gate(activation):
    ffn = randomized(GatedFFN(DIMS, 48, activation))
    x = inputs()
    gate, up = np.array(ffn.gate_proj(x)), np.array(ffn.up_proj(x))
    if activation == "silu":
        act = gate / (1 + np.exp(-gate))
    else:
        act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
    np.testing.assert_allclose(np.array(ffn(x)), np.array(ffn.down_proj(mx.array(act * up))), atol=1e-5)


def test_four_norm_block_normalises_each_sub_layer_before_and_after():
    norms = [randomized(RMSNorm(DIMS), seed) for seed in range(4)]
    block = FourNormBlock(attention(), randomized(GatedFFN(DIMS, 48)), *norms)
    x = inputs()
    mid = x + norms[2](block.attn(norms[0](x)))
    expected = mid + norms[3](block.ffn(norms[1](mid)))
    np.testing.assert_allclose(np.array(block(x)), np.array(expected), atol=1e-5)


def test_embedding_scale_and_logit_cap():
    embed, norm = randomized(nn.Embedding(16, 64)), randomized(RMSNorm(64))
    plain, gemma = Transformer(embed, [], norm), Transformer(embed, [], norm, embed_scale=64**0.5, logit_cap=3.0)
    ids = mx.array([[1, 2, 3]])
    expected = 3 * np.tanh(np.array(plain.unembed(norm(embed(ids) * 8.0))) / 3)
    np.testing.assert_allclose(np.array(gemma(ids)), expected, rtol=1e-5, atol=1e-6)


def test_embedding_scale_is_rounded_to_the_embeddings_dtype():
    """sqrt(3072) = 55.43 becomes 55.5 in bfloat16, as transformers rounds it."""
    model = Transformer(nn.Embedding(16, 64), [], RMSNorm(64), embed_scale=3072**0.5)
    model.embed.weight = mx.ones((16, 64), mx.bfloat16)
    recorder = Recorder(["embed"])
    model(mx.array([[1]]), recorder=recorder)
    assert recorder.values["embed"].dtype == mx.bfloat16 and recorder.values["embed"][0, 0, 0].item() == 55.5


@pytest.mark.parametrize(
    "dims, traditional, scaling",
    [
        (16, False, None),
        (16, True, None),
        (8, False, None),
        (8, True, None),
        (16, False, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ],
)
def test_one_token_rope_equals_the_rotation_formula(dims, traditional, scaling):
    """A decode step's RoPE at an array position (on the CPU, spelled out instead of `fast.rope`) against the
    rotation written out in numpy: each pair (i, i + dims/2), or (2i, 2i + 1) when traditional, turned by
    position / wavelength_i; features past `dims` untouched."""
    rope = use_cpu_forms(RoPE(dims, 500.0, scaling, max_positions=256, traditional=traditional))
    x = mx.random.normal((1, 3, 1, 16), key=mx.random.key(dims))
    for position in (0, 7, 1000):
        got = np.array(rope(x, mx.array([position])))
        wavelengths = np.array(rope._wavelengths, dtype=np.float64)
        angles = position / wavelengths
        cos, sin = np.cos(angles), np.sin(angles)
        v = np.array(x, dtype=np.float64)
        first, second = (
            (v[..., 0:dims:2], v[..., 1:dims:2]) if traditional else (v[..., : dims // 2], v[..., dims // 2 : dims])
        )
        want = v.copy()
        turned = (first * cos - second * sin, first * sin + second * cos)
        if traditional:
            want[..., 0:dims:2], want[..., 1:dims:2] = turned
        else:
            want[..., : dims // 2], want[..., dims // 2 : dims] = turned
        want *= rope.output_scale
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(1, position / 100))
        eager = np.array(RoPE.rotate(rope, x, Positions(1, position)))  # MLX's fast.rope
        np.testing.assert_allclose(got, eager, rtol=0, atol=2e-5 * max(1, position / 100))


@pytest.mark.parametrize("length", [13, 200, 1500])
def test_top_k_selection_keeps_what_torchs_topk_keeps(length):
    """Rows full of ties (and -inf, as masked keys score): `kept` and sparse attention's mask choose the indices
    torch's CPU topk does, by introselect (k * 64 > length) and by heap selection (k * 64 <= length)."""
    from reference import require

    from minimlx.core.selection import kept
    from minimlx.core.sparse_attention import top_k_keys

    torch = require("torch")
    rng = np.random.default_rng(length)
    rows = rng.choice(np.array([0.0, 0.0, 0.0, 1.0, 2.0, -np.inf, 0.5], np.float32), size=(24, length))
    for i, row in enumerate(rows):
        k = int(rng.integers(1, max(2, length // 64) if i % 2 else length))
        expected = sorted(torch.tensor(row).topk(k).indices.tolist())
        assert kept(row.tolist(), k) == expected
        assert np.flatnonzero(np.array(top_k_keys(mx.array(row[None]), k))[0]).tolist() == expected
