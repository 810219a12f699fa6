"""The native kernel's Gated DeltaNet step (`delta_step`, the CPU form `NativeGatedDeltaNet`) against the core
layer's MLX ops: the same output and states, one token at a time over a state a prompt left."""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

if os.environ.get("CI"):  # CI installs the kernel (.ci/run): missing there is a failure
    import minimlx_native
else:
    minimlx_native = pytest.importorskip(
        "minimlx_native", reason="the native kernel is not installed (pip install -v -e . says why)"
    )

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from minimlx.core import Block, GatedDeltaNet, RecurrentCache, RMSNorm, SwiGLU  # noqa: E402
from minimlx.core.steps import decode_steps  # noqa: E402
from minimlx.cpu import forms  # noqa: E402
from minimlx.cpu.forms import NativeBlock, NativeGatedDeltaNet, use_cpu_forms  # noqa: E402
from minimlx.cpu.linear import NativeBlockLinear  # noqa: E402


def random_delta_net(key_heads: int, value_heads: int, dims: int = 48) -> GatedDeltaNet:
    mx.random.seed(key_heads * 10 + value_heads)
    layer = GatedDeltaNet(
        dims=dims, key_heads=key_heads, value_heads=value_heads, key_dims=16, value_dims=32, kernel=4, eps=1e-6
    )
    layer.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.3) for k, v in tree_flatten(layer.parameters())]))
    layer.A_log = mx.random.normal((value_heads,)) * 0.5
    layer.dt_bias = mx.random.normal((value_heads,))
    return layer


@pytest.mark.parametrize("batch, key_heads, value_heads", [(1, 2, 2), (2, 2, 4), (3, 1, 3)])
def test_delta_step_equals_the_core_layers_ops(batch, key_heads, value_heads):
    layer = random_delta_net(key_heads, value_heads)
    xs = mx.random.normal((batch, 9, 48))
    caches = {form: RecurrentCache.merge([RecurrentCache() for _ in range(batch)]) for form in ("core", "native")}
    outputs = {}
    for form, cache in caches.items():
        layer.__class__ = NativeGatedDeltaNet if form == "native" else GatedDeltaNet
        steps = [layer(xs[:, :5], cache)]
        assert NativeGatedDeltaNet.steps(layer, xs[:, 5:6], cache)
        steps += [layer(xs[:, t : t + 1], cache) for t in range(5, 9)]
        outputs[form] = mx.concatenate(steps, axis=1)
        mx.eval(outputs[form], cache.state)
    for got, want in zip([outputs["native"], *caches["native"].state], [outputs["core"], *caches["core"].state]):
        got, want = np.array(got), np.array(want)
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    assert caches["native"].lengths == [9] * batch


def test_delta_step_refuses_what_it_does_not_read():
    layer = random_delta_net(2, 4)
    cache = RecurrentCache()
    layer(mx.random.normal((1, 3, 48)), cache)
    qkv, z = mx.zeros((1, 1, 2 * 32 + 4 * 32)), mx.zeros((1, 1, 4 * 32))
    args = (qkv, cache.conv, layer.conv1d.weight, mx.zeros((1, 1, 4)), mx.zeros((1, 1, 4)), z)
    rest = (layer.dt_bias, layer.A_log, layer.norm.weight)
    with pytest.raises(ValueError, match="qkv's channels must be"):
        minimlx_native.delta_step(*args, *rest, cache.recurrent, key_heads=4, key_dims=16, eps=1e-6)
    with pytest.raises(ValueError, match="every input must be float32"):
        minimlx_native.delta_step(*args, *rest, cache.recurrent.astype(mx.float16), key_heads=2, key_dims=16, eps=1e-6)


def q8_0_delta_block() -> Block:
    """A pre-norm block around a random Gated DeltaNet with a SwiGLU, every projection Q8_0 blocks (gguf-py's)."""
    mx.random.seed(3)
    block = Block(random_delta_net(2, 4, 64), SwiGLU(64, 96), RMSNorm(64), RMSNorm(64))
    block.update(
        tree_unflatten([(k, v + 0.1 * mx.random.normal(v.shape)) for k, v in tree_flatten(block.parameters())])
    )
    use_cpu_forms(block)
    for parent in (block.attn, block.ffn):
        for name, linear in list(parent.children().items()):
            if isinstance(linear, nn.Linear):
                stored = NativeBlockLinear(*linear.weight.shape, "q8_0")
                stored.weight = mx.array(quantize(np.array(linear.weight), GGMLQuantizationType.Q8_0))
                setattr(parent, name, stored)
    return block


@pytest.mark.parametrize("batch", [1, 2])
def test_delta_block_step_gives_the_bits_of_its_ops(batch, monkeypatch):
    """A decode step of the block as one `delta_block_step` equals, bit for bit, the same step with each part its own
    op (the projections' integer products, `delta_step`, the norms and the SwiGLU)."""
    block = q8_0_delta_block()
    assert type(block) is NativeBlock
    xs = mx.random.normal((batch, 8, 64))
    steps = {}
    for fused in (True, False):
        plan = forms.delta_plan(block)
        monkeypatch.setattr(plan, "types", plan.types if fused else None)
        cache = RecurrentCache.merge([RecurrentCache() for _ in range(batch)])
        block(xs[:, :5], cache)
        with decode_steps():
            assert plan.takes(xs[:, 5:6], cache) == fused
            steps[fused] = [block(xs[:, t : t + 1], cache) for t in range(5, 8)] + cache.state
        mx.eval(steps[fused])
    assert all(mx.array_equal(a, b).item() for a, b in zip(steps[True], steps[False]))
