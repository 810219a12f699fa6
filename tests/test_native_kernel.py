"""The optional native kernel (native/, `pip install ./native`): its products against MLX's, and
greedy decoding through it against float32 BLAS on SmolLM2."""

import os

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_generate import smollm2_path

if os.environ.get("CI"):  # CI installs the kernel (.ci/run): missing there is a failure
    import minimlx_native
else:
    minimlx_native = pytest.importorskip(
        "minimlx_native", reason="the native kernel is not installed (pip install ./native)")

from minimlx import load  # noqa: E402
from minimlx.core.quantized import KernelEmbedding, KernelLinear  # noqa: E402
from minimlx.core.sampling import make_sampler  # noqa: E402
from minimlx.generate import generate_tokens  # noqa: E402
from minimlx.loading import default_dtype  # noqa: E402


def packed(rows: int, cols: int, group_size: int, bits: int, seed: int):
    mx.random.seed(seed)
    return mx.quantize(mx.random.normal((rows, cols)), group_size, bits)


def assert_float32_close(got, want, x, weight):
    """Equal up to float32 rounding: within 1e-5 of the sum of |x| |w| each entry adds up."""
    bound = mx.abs(x) @ mx.abs(weight).T
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.all(mx.abs(got - want) <= 1e-5 * bound + 1e-30).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
@pytest.mark.parametrize("shape", [(7, 64), (577, 128), (96, 1536)])
def test_product_equals_mlx(bits, group_size, rows, shape):
    w, scales, biases = packed(*shape, group_size, bits, seed=rows)
    x = mx.random.normal((rows, shape[1]))
    got = minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits)
    weight = mx.dequantize(w, scales, biases, group_size, bits)
    assert_float32_close(got, x @ weight.T, x, weight)
    want = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    assert_float32_close(got, want, x, weight)


def test_batched_and_strided_inputs():
    w, scales, biases = packed(40, 128, 32, 4, seed=0)
    weight = mx.dequantize(w, scales, biases, 32, 4)
    x = mx.random.normal((3, 2, 128))
    got = minimlx_native.quantized_matmul(x, w, scales, biases, 32, 4)
    assert got.shape == (3, 2, 40)
    assert_float32_close(got.reshape(6, 40), x.reshape(6, 128) @ weight.T, x.reshape(6, 128), weight)
    strided = mx.random.normal((128, 5)).T  # rows of x not contiguous in memory
    got = minimlx_native.quantized_matmul(strided, w, scales, biases, 32, 4)
    assert_float32_close(got, strided @ weight.T, strided, weight)


@pytest.mark.parametrize("bits, group_size, message", [(3, 32, "bits must be 4 or 8"),
                                                      (4, 48, "group_size must be a multiple of 32")])
def test_refuses_layouts_it_does_not_read(bits, group_size, message):
    x = mx.zeros((1, 96))
    w, scales, biases = mx.quantize(mx.zeros((8, 96)), 32, 4)
    with pytest.raises(ValueError, match=message):
        minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits)


def test_linear_and_tied_head_forms_equal_mlx():
    mx.random.seed(0)
    linear = nn.Linear(64, 24)
    kernel, reference = KernelLinear.from_linear(linear, 32, 4), nn.QuantizedLinear.from_linear(linear, 32, 4)
    x = mx.random.normal((2, 64))
    weight = mx.dequantize(reference.weight, reference.scales, reference.biases, 32, 4)
    assert_float32_close(kernel(x), reference(x), x, weight)
    embedding = nn.Embedding(50, 64)
    kernel, reference = KernelEmbedding.from_embedding(embedding, 32, 8), nn.QuantizedEmbedding.from_embedding(
        embedding, 32, 8)
    weight = mx.dequantize(reference.weight, reference.scales, reference.biases, 32, 8)
    assert_float32_close(kernel.as_linear(x), reference.as_linear(x), x, weight)


def test_quantized_runs_through_the_kernel_unless_switched_off(monkeypatch):
    """The CPU default stays float32 (the kernel decodes SmolLM2 about 2x faster, not over the 2x bar); `--dtype
    quantized` puts the packed linear maps on the kernel, and MINIMLX_NATIVE=off on MLX's own packed kernels."""
    assert default_dtype() == "float32"
    model, _ = load(smollm2_path(), dtype="quantized")
    assert isinstance(model.layers[0].attn.q_proj, KernelLinear)
    monkeypatch.setenv("MINIMLX_NATIVE", "off")
    model, _ = load(smollm2_path(), dtype="quantized")
    assert type(model.layers[0].attn.q_proj) is nn.QuantizedLinear


def test_smollm2_greedy_tokens_equal_float32_blas():
    """Quantized, the GGUF's packed weights run through the kernel; in float32 they are dequantized for BLAS.
    32 greedy tokens are the same."""
    smollm2_path()
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    ids = {}
    for dtype in ("quantized", "float32"):
        model, _ = load("smollm2-135m", dtype)
        ids[dtype] = list(generate_tokens(model, prompt, model.make_cache(), make_sampler(), 32, 512))
        modules = [m for _, m in model.named_modules()]
        on_kernel = [m for m in modules if isinstance(m, (KernelLinear, KernelEmbedding))]
        assert len(on_kernel) == (30 * 7 + 1 if dtype == "quantized" else 0)  # every projection and the tied head
        float32 = [m for m in modules if type(m) is nn.Linear and m.weight.dtype == mx.float32]
        assert len(float32) == (0 if dtype == "quantized" else 30 * 7)
    assert ids["quantized"] == ids["float32"] and len(ids["float32"]) == 32


@pytest.mark.parametrize("batch, heads, kv_heads, queries, past, head_dim",
                         [(1, 9, 3, 128, 0, 64), (2, 6, 2, 37, 50, 128), (1, 4, 4, 1, 9, 64), (1, 8, 1, 130, 70, 80),
                          (1, 2, 1, 17, 0, 256)])
def test_causal_attention_equals_mlx(batch, heads, kv_heads, queries, past, head_dim):
    """Grouped heads, a chunk that continues a cache (past keys), queries handed in as a transposed view, and
    as one whose rows are not contiguous (copied first)."""
    keys = [mx.random.key(i) for i in range(3)]
    q = mx.random.normal((batch, queries, heads, head_dim), key=keys[0]).transpose(0, 2, 1, 3)
    k, v = (mx.random.normal((batch, kv_heads, past + queries, head_dim), key=key) for key in keys[1:])
    scale = head_dim**-0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if queries > 1 else None)
    got = minimlx_native.causal_attention(q, k, v, scale)
    assert got.shape == want.shape and mx.abs(got - want).max().item() < 2e-6
    transposed_rows = mx.random.normal((batch, heads, head_dim, queries), key=keys[0]).swapaxes(2, 3)
    want = mx.fast.scaled_dot_product_attention(transposed_rows, k, v, scale=scale,
                                                mask="causal" if queries > 1 else None)
    assert mx.abs(minimlx_native.causal_attention(transposed_rows, k, v, scale) - want).max().item() < 2e-6


@pytest.mark.parametrize("q_shape, k_shape, message", [((1, 4, 8, 72), (1, 2, 8, 72), "multiple of 16"),
                                                       ((1, 3, 8, 64), (1, 2, 8, 64), "divides q's"),
                                                       ((1, 2, 9, 64), (1, 2, 8, 64), "at least as many keys")])
def test_causal_attention_refuses_shapes_it_does_not_read(q_shape, k_shape, message):
    with pytest.raises(ValueError, match=message):
        minimlx_native.causal_attention(mx.zeros(q_shape), mx.zeros(k_shape), mx.zeros(k_shape), 1.0)


def test_smollm2_greedy_tokens_equal_with_and_without_native_attention(monkeypatch, smollm2):
    """Prefill attention through the kernel (float32 weights, a 130-token prompt in chunks of 64 so that the
    second and third continue the cache) gives the same 16 greedy tokens as MLX's ops."""
    model, tokenizer = smollm2
    prompt = tokenizer.encode("The history of the lighthouse begins with fires lit on hills by the sea. " * 9)[:130]
    ids = {}
    for setting in ("on", "off"):
        monkeypatch.setenv("MINIMLX_NATIVE", setting)
        ids[setting] = list(generate_tokens(model, prompt, model.make_cache(), make_sampler(), 16, 64))
    assert len(prompt) == 130 and ids["on"] == ids["off"] and len(ids["on"]) == 16
