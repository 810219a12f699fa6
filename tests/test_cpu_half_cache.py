"""Float16 KV caches on the CPU (`cpu.forms.halves_cache`): the native attention over float16 keys and values against
the same attention over them widened to float32, the fused decode step's float16 keys, and SmolLM2's packed model,
which caches in float16 by default (float32 under `--exact`), against a float32 cache."""

import os

import mlx.core as mx
import pytest
from models import smollm2_path

if os.environ.get("CI"):  # CI installs the kernel (.ci/run): missing there is a failure
    import minimlx_native  # noqa: F401
else:
    pytest.importorskip("minimlx_native", reason="the native kernel is not installed (pip install -v -e . says why)")

from minimlx import load  # noqa: E402
from minimlx.core.steps import decode_steps  # noqa: E402
from minimlx.cpu import forms, native  # noqa: E402
from minimlx.decode.compiled import CompiledDecoder  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_packed():
    smollm2_path()
    return load("smollm2-135m", "quantized")


def widened(a: mx.array) -> mx.array:
    return a.astype(mx.float32)


@pytest.mark.parametrize(
    "queries, keys, hidden",
    [(37, 80, None), (1, 300, None), (1, 3000, None), (1, 3000, "a fixed cache's tail"), (4, 700, "at random")],
)
def test_attention_over_float16_keys_and_values_is_attention_over_them_widened(queries, keys, hidden):
    """The same bits as over the float32 values the float16 ones stand for: a prompt's chunk, a decode step (its keys
    split into segments past 512), a fixed cache's hidden tail, keys hidden at random."""
    q, k, v = (
        mx.random.normal(shape, key=mx.random.key(i))
        for i, shape in enumerate([(1, 9, queries, 64), (1, 3, keys, 64), (1, 3, keys, 64)])
    )
    k, v = k.astype(mx.float16), v.astype(mx.float16)
    if hidden is None:
        got, want = (native.kernel.causal_attention(q, a, b, 0.125) for a, b in [(k, v), (widened(k), widened(v))])
    else:
        shown = {
            "a fixed cache's tail": (mx.arange(keys) < keys - 123)[None, None, None],
            "at random": mx.random.uniform(shape=(1, 1, queries, keys), key=mx.random.key(5)) > 0.3,
        }[hidden]
        got, want = (
            native.kernel.masked_attention(q, a, b, 0.125, shown) for a, b in [(k, v), (widened(k), widened(v))]
        )
    assert got.dtype == mx.float32 and mx.array_equal(got, want).item()


def test_attention_refuses_keys_and_values_of_two_types():
    q, k = mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 4, 16))
    with pytest.raises(ValueError, match="k and v both float32 or both float16"):
        native.kernel.causal_attention(q, k.astype(mx.float16), k, 1.0)
    with pytest.raises(ValueError, match="k and v both float32 or both float16"):
        native.kernel.causal_attention(q, k.astype(mx.bfloat16), k.astype(mx.bfloat16), 1.0)


@pytest.mark.slow
def test_block_step_writes_float16_keys_and_values_rounded_from_its_float32_ones(smollm2_packed):
    """`block_step` writes the token's keys and values at `start` of buffers of either type, float16 ones rounded from
    the float32 ones; buffers something else still holds (here the test), contiguous or not, are left as they were."""
    model, _ = smollm2_packed
    block = model.layers[5]
    attn, plan = block.attn, forms.step_plan(block)
    cos, sin = (a[0] for a in mx.split(mx.random.uniform(shape=(2, attn.rope.dims // 2)), 2))
    x = mx.random.normal((1, 1, 576))
    shape = (1, attn.kv_heads, 8, attn.head_dim)
    # the second a slice of a wider buffer (as a batch's kept columns are): copied row by row
    held = [mx.random.normal(shape), mx.random.normal((*shape[:2], 12, shape[3]))[:, :, 2:10]]

    def step(dtype):
        buffers = [b.astype(dtype) for b in held]
        mx.eval(buffers)
        before = [mx.array(b) for b in buffers]
        _, keys, values = native.kernel.block_step(x, buffers, mx.array([3]), plan.weights(), cos, sin, **plan.settings)
        assert all(mx.array_equal(b, a).item() for b, a in zip(buffers, before))  # held here: written into copies
        for written, original in zip((keys, values), before):
            others = mx.concatenate([written[:, :, :3], written[:, :, 4:]], axis=2)
            assert mx.array_equal(others, mx.concatenate([original[:, :, :3], original[:, :, 4:]], axis=2)).item()
        return keys[:, :, 3], values[:, :, 3]

    (k32, v32), (k16, v16) = step(mx.float32), step(mx.float16)
    assert (k16.dtype, v16.dtype) == (mx.float16, mx.float16)
    assert mx.array_equal(k16, k32.astype(mx.float16)).item() and mx.array_equal(v16, v32.astype(mx.float16)).item()


@pytest.mark.slow
def test_a_packed_model_caches_in_float16_unless_exact(smollm2_packed, monkeypatch):
    """SmolLM2's Q4_1 weights cache their keys and values in float16, half the bytes; `--exact` keeps float32."""
    model, tokenizer = smollm2_packed
    prompt = mx.array([tokenizer.encode("The capital of France is")])
    nbytes = {}
    for exact in (False, True):
        monkeypatch.setattr(native, "exact_products", exact)
        cache = CompiledDecoder(model).make_cache()
        mx.eval(model(prompt, cache))
        assert {c.keys.dtype for c in cache} == {mx.float32 if exact else mx.float16}
        nbytes[exact] = sum(c.nbytes for c in cache)
    assert nbytes[False] * 2 == nbytes[True]


@pytest.mark.slow
def test_smollm2_greedy_ids_over_a_float16_cache_equal_a_float32_caches(smollm2_packed, monkeypatch):
    """With float32 inputs to every product, 96 greedy tokens through the compiled step (its fused blocks reading the
    float16 cache) are those of a float32 cache, and the logits stay within 0.05 (2,048 of 2,048 teacher-forced steps
    agreed over four prompts of benchmarks/integer_products.py)."""
    model, tokenizer = smollm2_packed
    monkeypatch.setattr(native, "exact_products", True)
    halves = forms.halves_cache

    def run(half: bool) -> tuple[list[int], list[mx.array]]:
        monkeypatch.setattr(forms, "halves_cache", lambda attn, k, cache: half and k.dtype == mx.float32)
        decoder = CompiledDecoder(model)
        cache = decoder.make_cache()
        prompt = mx.array([tokenizer.encode("Write a short story about a robot who learns to paint.")])
        logits = [decoder(prompt, cache, last_only=True)[0, -1]]
        ids = []
        with decode_steps():
            for _ in range(96):
                ids.append(mx.argmax(logits[-1]).item())
                logits.append(decoder(mx.array([ids[-1:]]), cache)[0, -1])
        assert {c.keys.dtype for c in cache} == {mx.float16 if half else mx.float32}
        return ids, logits

    (half_ids, half_logits), (float_ids, float_logits) = run(True), run(False)
    monkeypatch.setattr(forms, "halves_cache", halves)
    assert half_ids == float_ids
    assert max(mx.abs(a - b).max().item() for a, b in zip(half_logits, float_logits)) < 0.05
