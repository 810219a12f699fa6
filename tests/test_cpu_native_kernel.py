"""The native kernel (native/, built by `pip install -e .` where it can be): its products against MLX's, and
greedy decoding through it against float32 BLAS on SmolLM2."""

import os
import re
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from models import smollm2_path
from native_checks import fused_and_alone, integer_against_float, per_instruction_set

if os.environ.get("CI"):  # CI installs the kernel (.ci/run): missing there is a failure
    import minimlx_native
else:
    minimlx_native = pytest.importorskip(
        "minimlx_native", reason="the native kernel is not installed (pip install -v -e . says why)"
    )

from minimlx import load, stream_generate  # noqa: E402
from minimlx.core.cache import quantized_cache, visible  # noqa: E402
from minimlx.core.ffn import SwiGLU  # noqa: E402
from minimlx.cpu import native  # noqa: E402
from minimlx.cpu.attention import attend  # noqa: E402
from minimlx.cpu.forms import CpuRoPE, use_cpu_forms  # noqa: E402
from minimlx.cpu.linear import (  # noqa: E402
    NATIVE_ROWS,
    NativeLinear,
    NativeQuantizedEmbedding,
    NativeQuantizedLinear,
    gated_product,
)
from minimlx.decode import Request, SamplingSettings, generate_tokens  # noqa: E402
from minimlx.decode.compiled import CompiledDecoder  # noqa: E402
from minimlx.decode.engine import Engine  # noqa: E402
from minimlx.loading import default_dtype  # noqa: E402


def packed(rows: int, cols: int, group_size: int, bits: int, seed: int):
    mx.random.seed(seed)
    return mx.quantize(mx.random.normal((rows, cols)), group_size, bits)


def assert_float32_close(got, want, x, weight, tolerance=1e-5):
    """Equal up to float32 rounding: within `tolerance` of the sum of |x| |w| each entry adds up."""
    bound = mx.abs(x) @ mx.abs(weight).T
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.all(mx.abs(got - want) <= tolerance * bound + 1e-30).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 33, 45, 61])
@pytest.mark.parametrize("shape", [(7, 64), (577, 128), (96, 1536)])
def test_product_equals_mlx(bits, group_size, rows, shape):
    """Input rows in blocks of 8, 4 and fewer; from 28, panels of the GEMM on dequantized weights, a few rows past
    the last full panel in blocks (33, 45: a 32-row panel and 1 or 13 rows), more in a padded panel (61)."""
    w, scales, biases = packed(*shape, group_size, bits, seed=rows)
    x = mx.random.normal((rows, shape[1]))
    got = minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits, exact=True)
    weight = mx.dequantize(w, scales, biases, group_size, bits)
    assert_float32_close(got, x @ weight.T, x, weight)
    want = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    assert_float32_close(got, want, x, weight)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_product_with_groups_of_128_equals_mlx(bits, rows):
    """Group sizes other than 32 and 64 take the loop that reads the group size at run time (40 rows: the
    weights dequantized for the GEMM, which reads it at run time too)."""
    w, scales, biases = packed(40, 384, 128, bits, seed=rows)
    x = mx.random.normal((rows, 384))
    weight = mx.dequantize(w, scales, biases, 128, bits)
    assert_float32_close(
        minimlx_native.quantized_matmul(x, w, scales, biases, 128, bits, exact=True), x @ weight.T, x, weight
    )


def half_scales(w, scales, biases):
    """The layout with its scales and biases held in float16, and those upcast to float32."""
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    return (w, scales, biases), (w, scales.astype(mx.float32), biases.astype(mx.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("shape", [(7, 128), (96, 1536)])
def test_product_with_float16_scales_equals_them_upcast(bits, group_size, rows, shape):
    """Float16 scales and biases are widened as they are read: the product is the float32 kernel's on the same
    values upcast (but for the order of a few float32 additions), and MLX's own product with the float16 scales
    within float32 rounding."""
    half, upcast = half_scales(*packed(*shape, group_size, bits, seed=rows))
    x = mx.random.normal((rows, shape[1]))
    got = minimlx_native.quantized_matmul(x, *half, group_size, bits, exact=True)
    weight = mx.dequantize(*upcast, group_size, bits)
    assert_float32_close(
        got, minimlx_native.quantized_matmul(x, *upcast, group_size, bits, exact=True), x, weight, 1e-6
    )
    want = mx.quantized_matmul(x, *half, transpose=True, group_size=group_size, bits=bits)
    assert_float32_close(got, want, x, weight)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_swiglu_product_and_forms_with_float16_scales(rows, monkeypatch):
    """The gated product, a linear form and the embedding's lookup and tied head read float16 scales as their
    float32 upcast, and give float32."""
    monkeypatch.setattr(native, "exact_products", True)
    gate_half, gate = half_scales(*packed(96, 256, 64, 4, seed=rows))
    up_half, up = half_scales(*packed(96, 256, 64, 4, seed=rows + 1))
    x = mx.random.normal((rows, 256))
    got = minimlx_native.quantized_swiglu(x, *gate_half, *up_half, 64, 4, exact=True)
    want = minimlx_native.quantized_swiglu(x, *gate, *up, 64, 4, exact=True)
    assert got.dtype == mx.float32 and mx.abs(got - want).max().item() <= 1e-6 * mx.abs(want).max().item()
    up_weight, want = mx.dequantize(*up, 64, 4), minimlx_native.quantized_matmul(x, *up, 64, 4, exact=True)
    linear = NativeQuantizedLinear(256, 96, bias=False, group_size=64, bits=4)
    linear.weight, linear.scales, linear.biases = up_half
    assert_float32_close(linear(x), want, x, up_weight, 1e-6)
    embedding = NativeQuantizedEmbedding(96, 256, group_size=64, bits=4)
    embedding.weight, embedding.scales, embedding.biases = up_half
    assert_float32_close(embedding.as_linear(x), want, x, up_weight, 1e-6)
    ids = mx.array([3, 0, 95])
    assert embedding(ids).dtype == mx.float32
    assert mx.array_equal(embedding(ids), up_weight[ids]).item()


def test_refuses_scales_and_biases_of_two_types():
    w, scales, biases = packed(8, 64, 32, 4, seed=0)
    with pytest.raises(ValueError, match="scales and biases must be both float32 or both float16"):
        minimlx_native.quantized_matmul(mx.zeros((1, 64)), w, scales.astype(mx.float16), biases, 32, 4, exact=True)
    with pytest.raises(ValueError, match="scales and biases must be both float32 or both float16"):
        minimlx_native.quantized_matmul(
            mx.zeros((1, 64)), w, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16), 32, 4, exact=True
        )


def q8_inputs(x: mx.array):
    """x quantized per block of 32 values as the integer products take it: as llama.cpp's quantize_row_q8_1 does
    (d = max |x| / 127, x / d rounded to the nearest integer), and for a block whose largest value is more than 1.5
    times the row's median block's, a second part quantized the same way from what the first leaves. Returns what the
    parts stand for, and each value's last step (d2 where its block has a second part, else d)."""

    def quantize(blocks):
        d = mx.max(mx.abs(blocks), axis=-1, keepdims=True) / 127
        return mx.round(blocks * mx.where(d > 0, 1 / d, 0)), d

    blocks = x.reshape(*x.shape[:-1], -1, 32)
    codes, d = quantize(blocks)
    wide = np.array(blocks).astype(np.float64)  # x - d * codes with one rounding, as the kernel's fma
    rest = mx.array((wide - np.array(d).astype(np.float64) * np.array(codes)).astype(np.float32))
    codes2, d2 = quantize(rest)
    largest = d * 127
    median = mx.sort(largest, axis=-2)[..., largest.shape[-2] // 2 : largest.shape[-2] // 2 + 1, :]
    second = largest > 1.5 * median
    value = codes * d + mx.where(second, codes2 * d2, 0)
    step = mx.broadcast_to(mx.where(second, d2, d), blocks.shape)
    return value.reshape(x.shape), step.reshape(x.shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 6, 27])
@pytest.mark.parametrize("shape", [(7, 384), (96, 1536), (33, 96)])
@pytest.mark.parametrize("half", [False, True])
def test_integer_product_equals_the_product_of_q8_inputs(bits, group_size, rows, shape, half):
    """Fewer than 28 rows take the integer products: x quantized per block of 32 as llama.cpp's Q8 activations (with a
    second part for blocks set by outliers), times the dequantized weight, to float32 rounding (96 features: a last
    step of AVX-512's 64 half full). Its error against float32 inputs is that of the inputs' rounding, at most half a
    last step d / 2 per value: |error| <= sum_k |w_k| d_k / 2."""
    if 96 % group_size and shape[1] == 96:
        pytest.skip("groups wider than the row")
    w, scales, biases = packed(*shape, group_size, bits, seed=rows)
    if half:
        (w, scales, biases), _ = half_scales(w, scales, biases)
    x = mx.random.normal((rows, shape[1]))
    weight = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
    got = minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits)
    if rows == 6:  # outliers: some blocks take a second part
        x = x * mx.where(mx.arange(shape[1]) % 37 == 5, 30.0, 1.0)
        got = minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits)
    value, d = q8_inputs(x)
    assert_float32_close(got, value @ weight.T, value, weight)
    exact = minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits, exact=True)
    assert mx.all(mx.abs(got - exact) <= (d / 2) @ mx.abs(weight).T * 1.001 + 1e-4).item()
    alone = mx.concatenate(
        [minimlx_native.quantized_matmul(x[i : i + 1], w, scales, biases, group_size, bits) for i in range(rows)]
    )
    assert mx.array_equal(got, alone).item()  # each row as it is alone: a batch's sequences get their own tokens


def test_integer_swiglu_product_equals_its_parts():
    gate, up = packed(96, 256, 32, 4, seed=1), packed(96, 256, 32, 4, seed=2)
    x = mx.random.normal((3, 256))
    gated = minimlx_native.quantized_matmul(x, *gate, 32, 4)
    want = gated * mx.sigmoid(gated) * minimlx_native.quantized_matmul(x, *up, 32, 4)
    got = minimlx_native.quantized_swiglu(x, *gate, *up, 32, 4)
    assert mx.abs(got - want).max().item() <= 1e-6 * mx.abs(want).max().item()


INSTRUCTION_SETS = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avxvnni", "avx512": "avx512vnni"}


@pytest.mark.slow  # starts a Python process per instruction set
def test_every_instruction_set_gives_the_portable_products(tmp_path):
    """MINIMLX_NATIVE_ISA caps the instruction set: each the CPU runs (maddubs, AVX-VNNI, AVX-512 VNNI) gives the
    scalar integer products, but for the order of the float32 sums of the blocks."""
    program = (
        "import sys\nimport minimlx\nimport mlx.core as mx\nimport minimlx_native as k\n"
        "mx.random.seed(0)\nx = mx.random.normal((5, 448))\nout = {}\n"
        "for bits in (4, 8):\n"
        "    for group_size in (32, 64):\n"
        "        w, s, b = mx.quantize(mx.random.normal((40, 448)), group_size, bits)\n"
        "        if group_size == 64:\n"
        "            s, b = s.astype(mx.float16), b.astype(mx.float16)\n"
        "        out[f'{bits}-{group_size}'] = k.quantized_matmul(x, w, s, b, group_size, bits)\n"
        "        weight = mx.dequantize(w, s, b, group_size, bits)\n"
        "        out[f'{bits}-{group_size}-bound'] = mx.abs(x) @ mx.abs(weight).T\n"
        "mx.savez(sys.argv[1], **out)\nprint(k.integer_isa)\n"
    )
    results = per_instruction_set(program, INSTRUCTION_SETS, tmp_path)
    reference = results.pop("scalar")
    for isa, got in results.items():
        for key in reference:
            if not key.endswith("bound"):
                assert mx.all(mx.abs(got[key] - reference[key]) <= 1e-6 * reference[key + "-bound"]).item(), (isa, key)
    with pytest.raises(subprocess.CalledProcessError):
        env = dict(os.environ, MINIMLX_NATIVE_ISA="sse9")
        subprocess.run([sys.executable, "-c", "import minimlx_native"], env=env, check=True, capture_output=True)


@pytest.fixture(scope="module")
def smollm2_quantized():
    smollm2_path()
    return load("smollm2-135m", "quantized")


@pytest.mark.slow
def test_smollm2_integer_products_follow_the_float_path(smollm2_quantized, monkeypatch):
    """Decoding SmolLM2's Q4_1 GGUF greedily with float32 inputs, the integer products' logits at each step (fed the
    same tokens) are within 1.0 of the float path's (logits of magnitude ~40; 0.34-0.60 over these 64 steps with
    AVX-512 VNNI, AVX2 and the scalar code, 1.26 at most over 4 x 512 steps, 0.17-0.24 at the median) and their
    greedy ids agree on at least 62 of 64 (63 or 64 measured; 2,038 of 2,048 over 4 x 512)."""
    model, tokenizer = smollm2_quantized
    prompt = mx.array([tokenizer.encode("Write a short story about a robot who learns to paint.")])
    agree, largest = integer_against_float(model, prompt, 64, monkeypatch)
    assert agree >= 62 and 0 < largest <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("exact, kv_bits", [(False, None), (True, None), (False, 8), (False, 4)])
def test_a_blocks_fused_decode_step_gives_the_bits_of_its_ops(smollm2_quantized, monkeypatch, exact, kv_bits):
    """The compiled step runs each SmolLM2 block as one `block_step` (30 per step); its logits
    over 24 greedy steps have exactly the bits of the same step with every part as its own op, with integer products
    and with float32 inputs, and over 8- and 4-bit caches (which the op writes as mx.quantize does)."""
    model, tokenizer = smollm2_quantized
    monkeypatch.setattr(native, "exact_products", exact)
    prompt = mx.array([tokenizer.encode("Write a short story about a robot who learns to paint.")])
    fused, alone, fused_calls, calls = fused_and_alone(
        model, prompt, 24, monkeypatch, lambda c: quantized_cache(c, kv_bits)
    )
    assert fused_calls == calls == len(model.layers)  # once per layer, as the step is traced
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused, alone))


@pytest.mark.slow
@pytest.mark.parametrize("kv_bits", [8, 4])
def test_compiled_decoding_over_a_quantized_cache_gives_the_ids_of_eager_decoding(smollm2_quantized, kv_bits):
    """`--kv-bits` decodes through the compiled step (its blocks as `block_step` over the codes) and gives the ids of
    eager decoding over a growing quantized cache, across a capacity growth (300 prompt tokens, 40 generated)."""
    model, tokenizer = smollm2_quantized
    prompt = (tokenizer.encode("Write a short story about a robot who learns to paint.") * 25)[:300]
    ids = []
    for compiled in (True, False):
        engine = Engine(model, max_batch=1, kv_bits=kv_bits, compiled=compiled)
        generation = engine.submit(Request(prompt, SamplingSettings(max_tokens=40), stop_ids=frozenset()))
        engine.run()
        ids.append(generation.tokens)
    assert len(ids[0]) == 40 and ids[0] == ids[1]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=mx.zeros((1, 2, 64))), "one token of each sequence"),
        (dict(x=mx.zeros((2, 1, 64))), "both of one type and shape (batch,"),
        (dict(cache=[mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16), mx.float16)]), "both of one type and shape"),
        (dict(cache=[mx.zeros((1, 2, 8, 4), mx.uint32)] + [mx.zeros((1, 2, 8, 1))] * 5), "4 or 8 bits in groups"),
        (dict(cache=[mx.zeros((1, 2, 8, 16))]), "the cache must be its keys and values"),
        (dict(heads=3), "bad head counts"),
        (dict(start=mx.array([0.0])), "start must be int32"),
        (dict(layouts=[32, 4] * 5), "layouts must be"),
        (dict(cos=mx.zeros((3,))), "cos and sin must be float32"),
        (dict(mask=mx.ones((1, 1, 1, 9), mx.bool_)), "keys at most the cache's capacity"),
    ],
)
def test_block_step_refuses_what_it_does_not_read(change, message):
    def packed(rows, columns):
        return list(mx.quantize(mx.zeros((rows, columns)), group_size=32, bits=4))

    args = dict(
        x=mx.zeros((1, 1, 64)),
        cache=[mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16))],
        start=mx.array([3]),
        weights=[mx.ones((64,)), *packed(64, 64), *packed(32, 64), *packed(32, 64), *packed(64, 64)]
        + [mx.ones((64,)), *packed(96, 64), *packed(96, 64), *packed(64, 96)],
        cos=mx.zeros((8,)),
        sin=mx.zeros((8,)),
        layouts=[32, 4] * 6,
        heads=4,
        kv_heads=2,
        rope_dims=16,
        traditional=False,
        scale=0.25,
        attn_eps=1e-5,
        ffn_eps=1e-5,
    )
    y, keys, values = native.kernel.block_step(**args)
    assert (y.shape, keys.shape, values.shape) == ((1, 1, 64), (1, 2, 8, 16), (1, 2, 8, 16))
    with pytest.raises(ValueError, match=f"^minimlx_native.block_step: .*{re.escape(message)}"):
        native.kernel.block_step(**(args | change))


def test_batched_and_strided_inputs():
    w, scales, biases = packed(40, 128, 32, 4, seed=0)
    weight = mx.dequantize(w, scales, biases, 32, 4)
    x = mx.random.normal((3, 2, 128))
    got = minimlx_native.quantized_matmul(x, w, scales, biases, 32, 4, exact=True)
    assert got.shape == (3, 2, 40)
    assert_float32_close(got.reshape(6, 40), x.reshape(6, 128) @ weight.T, x.reshape(6, 128), weight)
    strided = mx.random.normal((128, 5)).T  # rows of x not contiguous in memory
    got = minimlx_native.quantized_matmul(strided, w, scales, biases, 32, 4, exact=True)
    assert_float32_close(got, strided @ weight.T, strided, weight)


@pytest.mark.parametrize(
    "bits, group_size, message", [(3, 32, "bits must be 4 or 8"), (4, 48, "group_size must be a multiple of 32")]
)
def test_refuses_layouts_it_does_not_read(bits, group_size, message):
    x = mx.zeros((1, 96))
    w, scales, biases = mx.quantize(mx.zeros((8, 96)), 32, 4)
    with pytest.raises(ValueError, match=message):
        minimlx_native.quantized_matmul(x, w, scales, biases, group_size, bits, exact=True)


def test_linear_and_tied_head_forms_equal_mlx():
    mx.random.seed(0)
    linear = nn.Linear(64, 24)
    kernel, reference = NativeQuantizedLinear.from_linear(linear, 32, 4), nn.QuantizedLinear.from_linear(linear, 32, 4)
    x = mx.random.normal((2, 64))
    weight = mx.dequantize(reference.weight, reference.scales, reference.biases, 32, 4)
    assert_float32_close(kernel(x), reference(x), x, weight)
    embedding = nn.Embedding(50, 64)
    kernel, reference = (
        NativeQuantizedEmbedding.from_embedding(embedding, 32, 8),
        nn.QuantizedEmbedding.from_embedding(embedding, 32, 8),
    )
    weight = mx.dequantize(reference.weight, reference.scales, reference.biases, 32, 8)
    assert_float32_close(kernel.as_linear(x), reference.as_linear(x), x, weight)


@pytest.mark.slow
def test_quantized_runs_through_the_kernel_unless_switched_off(monkeypatch):
    """By default on the CPU (the kernel decodes SmolLM2 3.4-3.7x faster than float32 BLAS) and with `--dtype
    quantized`, the packed linear maps run on the kernel; MINIMLX_NATIVE=off puts `--dtype quantized` on MLX's
    own packed kernels."""
    assert default_dtype() is None
    for dtype in (None, "quantized"):
        model, _ = load(smollm2_path(), dtype=dtype)
        assert isinstance(model.layers[0].attn.q_proj, NativeQuantizedLinear)
        assert isinstance(model.embed, NativeQuantizedEmbedding)
    monkeypatch.setattr(native, "kernel", None)  # what MINIMLX_NATIVE=off gives at import
    model, _ = load(smollm2_path(), dtype="quantized")
    assert type(model.layers[0].attn.q_proj) is nn.QuantizedLinear


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_float32_blas(monkeypatch):
    """Quantized, the GGUF's packed weights run through the kernel (float32 inputs); in float32 they are
    dequantized, and its products run on BLAS for one row and the kernel's float32 GEMM for the prompt. 32 greedy
    tokens are the same."""
    monkeypatch.setattr(native, "exact_products", True)
    smollm2_path()
    prompt = [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
        198,
        1,
        4093,
        198,
        1780,
        314,
        260,
        3575,
        282,
        4649,
        47,
        2,
        198,
        1,
        520,
        9531,
        198,
    ]
    ids = {}
    for dtype in ("quantized", "float32"):
        model, _ = load("smollm2-135m", dtype)
        ids[dtype] = list(generate_tokens(model, prompt, model.make_cache(), SamplingSettings(32), 512))
        modules = [m for _, m in model.named_modules()]
        on_kernel = [m for m in modules if isinstance(m, (NativeQuantizedLinear, NativeQuantizedEmbedding))]
        assert len(on_kernel) == (30 * 7 + 1 if dtype == "quantized" else 0)  # every projection and the tied head
        float32 = [m for m in modules if type(m) is NativeLinear and m.weight.dtype == mx.float32]
        assert len(float32) == (0 if dtype == "quantized" else 30 * 7)
    assert ids["quantized"] == ids["float32"] and len(ids["float32"]) == 32


@pytest.mark.slow
def test_smollm2_quantized_batch_greedy_tokens_equal_each_prompt_alone(monkeypatch):
    """With float32 inputs, batched, the kernel's blocks of 8 and 4 input rows dequantize each weight chunk once for
    all of them; alone, its one-row loop sums the packed integers per group. 16 greedy tokens of each prompt are
    the same."""
    monkeypatch.setattr(native, "exact_products", True)
    from models import PROMPTS, run_batch, smollm2_ids

    model, tokenizer = load("smollm2-135m", "quantized")
    alone = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=16)] for p in PROMPTS]
    batched = run_batch(model, tokenizer, [Request(ids, SamplingSettings(16)) for ids in smollm2_ids(tokenizer)])
    assert len(PROMPTS) == 8 and batched == alone


@pytest.mark.parametrize(
    "batch, heads, kv_heads, queries, past, head_dim",
    [(1, 9, 3, 128, 0, 64), (2, 6, 2, 37, 50, 128), (1, 4, 4, 1, 9, 64), (1, 8, 1, 130, 70, 80), (1, 2, 1, 17, 0, 256)],
)
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
    want = mx.fast.scaled_dot_product_attention(
        transposed_rows, k, v, scale=scale, mask="causal" if queries > 1 else None
    )
    assert mx.abs(minimlx_native.causal_attention(transposed_rows, k, v, scale) - want).max().item() < 2e-6


@pytest.mark.parametrize(
    "q_shape, k_shape, message",
    [
        ((1, 4, 8, 72), (1, 2, 8, 72), "multiple of 16"),
        ((1, 3, 8, 64), (1, 2, 8, 64), "divides q's"),
        ((1, 2, 9, 64), (1, 2, 8, 64), "at least as many keys"),
    ],
)
def test_causal_attention_refuses_shapes_it_does_not_read(q_shape, k_shape, message):
    with pytest.raises(ValueError, match=message):
        minimlx_native.causal_attention(mx.zeros(q_shape), mx.zeros(k_shape), mx.zeros(k_shape), 1.0)


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_with_and_without_native_ops(monkeypatch, smollm2):
    """Prefill products and attention, decode attention, norms and rotary embeddings through the kernel (float32
    weights, a 130-token prompt in chunks of 64 so that the second and third continue the cache) give the same 16 greedy
    tokens as MLX's ops, decoding eagerly and in a compiled step (whose attention reads a masked fixed cache)."""
    _, tokenizer = smollm2
    prompt = tokenizer.encode("The history of the lighthouse begins with fires lit on hills by the sea. " * 9)[:130]
    ids = {}
    for setting, kernel in (("on", native.kernel), ("off", None)):
        monkeypatch.setattr(native, "kernel", kernel)  # the CPU forms are chosen when the model loads
        model, _ = load("smollm2-135m", dtype="float32")
        for runner in (model, CompiledDecoder(model)):
            ids[setting, type(runner)] = list(
                generate_tokens(runner, prompt, runner.make_cache(), SamplingSettings(16), 64)
            )
    assert len(prompt) == 130 and len(set(map(tuple, ids.values()))) == 1 and len(ids["on", CompiledDecoder]) == 16


@pytest.mark.parametrize(
    "batch, heads, kv_heads, queries, keys, mask_shape",
    [
        (1, 9, 3, 1, 256, (1, 1, 1, 256)),
        (4, 9, 3, 1, 40, (4, 1, 1, 40)),
        (3, 8, 2, 5, 20, (3, 1, 5, 20)),
        (2, 4, 4, 3, 9, (1, 1, 3, 9)),
    ],
)
def test_masked_attention_equals_mlx(batch, heads, kv_heads, queries, keys, mask_shape):
    """Keys hidden by a boolean mask as well as causally: a decode step over a cache of fixed capacity, padded
    rows of a batch, per-query masks; a query that sees no key gets zeros."""
    q, k, v = (
        mx.random.normal(shape, key=mx.random.key(i))
        for i, shape in enumerate(
            [(batch, heads, queries, 64), (batch, kv_heads, keys, 64), (batch, kv_heads, keys, 64)]
        )
    )
    mask = mx.random.uniform(shape=mask_shape, key=mx.random.key(3)) > 0.4
    causal = mx.arange(keys) <= (keys - queries + mx.arange(queries))[:, None]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask & causal)
    assert mx.abs(minimlx_native.masked_attention(q, k, v, 0.125, mask) - want).max().item() < 2e-6
    hidden = mx.zeros(mask_shape, dtype=mx.bool_)
    assert mx.all(minimlx_native.masked_attention(q, k, v, 0.125, hidden) == 0).item()
    with pytest.raises(ValueError, match="mask must be boolean"):
        minimlx_native.masked_attention(q, k, v, 0.125, mask.astype(mx.float32))


@pytest.mark.parametrize(
    "batch, heads, kv_heads, queries, keys, hidden",
    [
        (1, 9, 3, 1, 4096, "nothing"),
        (1, 9, 3, 1, 1000, "at random"),
        (1, 8, 1, 1, 5000, "a fixed cache's tail"),
        (2, 6, 2, 1, 3001, "a padded row"),
        (1, 4, 4, 5, 2000, "at random"),
    ],
)
def test_attention_of_few_queries_split_over_the_keys_equals_mlx(batch, heads, kv_heads, queries, keys, hidden):
    """Few blocks of queries (a decode step's one per batch row and kv head) have their keys split into segments
    whose softmax sums are combined (with 2 threads or more): grouped heads, keys hidden at random, past a fixed
    cache's last token (whole segments hidden), and every key of a padded batch row, which gets zeros while the
    other row sees only its first 7 keys."""
    q, k, v = (
        mx.random.normal(shape, key=mx.random.key(i))
        for i, shape in enumerate(
            [(batch, heads, queries, 64), (batch, kv_heads, keys, 64), (batch, kv_heads, keys, 64)]
        )
    )
    causal = mx.arange(keys) <= (keys - queries + mx.arange(queries))[:, None]
    if hidden == "nothing":
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=causal)
        assert mx.abs(minimlx_native.causal_attention(q, k, v, 0.125) - want).max().item() < 2e-6
        return
    shown = {
        "at random": mx.random.uniform(shape=(batch, 1, queries, keys), key=mx.random.key(3)) > 0.4,
        "a fixed cache's tail": (mx.arange(keys) < 4321)[None, None, None],
        "a padded row": mx.stack([mx.zeros(keys, dtype=mx.bool_), mx.arange(keys) < 7])[:, None, None],
    }[hidden]
    got = minimlx_native.masked_attention(q, k, v, 0.125, shown)
    seen = slice(1, None) if hidden == "a padded row" else slice(None)
    want = mx.fast.scaled_dot_product_attention(q[seen], k[seen], v[seen], scale=0.125, mask=shown[seen] & causal)
    assert mx.abs(got[seen] - want).max().item() < 2e-6
    assert hidden != "a padded row" or mx.all(got[0] == 0).item()


@pytest.mark.parametrize("seen", [300, 1500])
def test_a_decode_steps_attention_is_the_same_alone_batched_and_over_a_fixed_capacity(seen):
    """A decode step's query over its `seen` keys gives the same bits alone (causal), over a fixed cache's capacity
    (its tail hidden), left-padded in a batch beside a row of 4,100 keys, and as the last query of a speculative
    check: its keys are split by their number among those it sees, never by where they lie."""
    q, k, v = (
        mx.random.normal(shape, key=mx.random.key(i))
        for i, shape in enumerate([(1, 9, 4, 64), *[(1, 3, seen, 64)] * 2])
    )
    alone = minimlx_native.causal_attention(q[:, :, -1:], k, v, 0.125)
    capacity = 4352
    tail = mx.zeros((1, 3, capacity - seen, 64))
    fixed = minimlx_native.masked_attention(
        q[:, :, -1:],
        mx.concatenate([k, tail], axis=2),
        mx.concatenate([v, tail], axis=2),
        0.125,
        (mx.arange(capacity) < seen)[None, None, None],
    )
    longest, padding = 4100, 4100 - seen
    other = [mx.random.normal((1, 3, longest, 64), key=mx.random.key(9 + i)) for i in range(2)]
    padded = [mx.concatenate([mx.zeros((1, 3, padding, 64)), a], axis=2) for a in (k, v)]
    batch_mask = mx.stack([mx.ones(longest, dtype=mx.bool_), mx.arange(longest) >= padding])[:, None, None]
    batched = minimlx_native.masked_attention(
        mx.concatenate([q[:, :, -1:]] * 2), *(mx.concatenate([o, p]) for o, p in zip(other, padded)), 0.125, batch_mask
    )
    checked = minimlx_native.causal_attention(q, k, v, 0.125)[:, :, -1:]
    assert all(mx.array_equal(alone, x).item() for x in (fixed, batched[1:], checked))


@pytest.mark.parametrize("mask", ["padded prefill", "window", "padded window"])
def test_attend_takes_the_native_op_for_masked_prompts(mask, monkeypatch):
    """A batch's padded prefill and a sliding window's mask go to the native op (not MLX's composed attention,
    whose products wake the BLAS's threads) and give what MLX gives."""
    queries, keys, padding = 6, 10, [3, 0]
    q, k, v = (
        mx.random.normal(shape, key=mx.random.key(i))
        for i, shape in enumerate([(2, 6, queries, 64), (2, 2, keys, 64), (2, 2, keys, 64)])
    )
    window = 4 if "window" in mask else None
    shown = visible(0, keys - queries, queries, window, padding if "padded" in mask else ())
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=shown)
    calls = []
    monkeypatch.setattr(
        minimlx_native,
        "masked_attention",
        lambda *args: calls.append(args[-1].shape) or minimlx_native._ext.masked_attention(*args),
    )
    got = attend(q, k, v, 0.125, shown)
    assert calls == [(2 if "padded" in mask else 1, 1, queries, keys)]
    assert mx.abs(got - want).max().item() < 2e-6


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 45])
def test_swiglu_product_equals_its_parts(bits, group_size, rows):
    gate, up = packed(96, 128, group_size, bits, seed=1), packed(96, 128, group_size, bits, seed=2)
    x = mx.random.normal((rows, 128))
    gated = minimlx_native.quantized_matmul(x, *gate, group_size, bits, exact=True)
    want = gated * mx.sigmoid(gated) * minimlx_native.quantized_matmul(x, *up, group_size, bits, exact=True)
    got = minimlx_native.quantized_swiglu(x, *gate, *up, group_size, bits, exact=True)
    assert got.shape == want.shape and mx.abs(got - want).max().item() <= 1e-6 * mx.abs(want).max().item()
    with pytest.raises(ValueError, match="one shape"):
        minimlx_native.quantized_swiglu(
            x, *gate, *packed(32, 128, group_size, bits, seed=3), group_size, bits, exact=True
        )


def test_swiglu_gate_equals_mlx():
    gate, up = mx.random.normal((3, 70000)) * 4, mx.random.normal((3, 70000))  # several blocks of the pool's work
    want = gate * mx.sigmoid(gate) * up
    assert mx.abs(minimlx_native.swiglu(gate, up) - want).max().item() < 1e-5
    strided = gate.T
    assert mx.abs(minimlx_native.swiglu(strided, up.T) - want.T).max().item() < 1e-5
    with pytest.raises(ValueError, match="one shape"):
        minimlx_native.swiglu(gate, up[:, :5])


def test_swiglu_ffn_takes_the_fused_product():
    """A SwiGLU whose gate and up maps are kernel maps of one layout computes them in one op, equal to the
    three-op form; any other pairing keeps the separate ops."""
    mx.random.seed(0)
    ffn = use_cpu_forms(SwiGLU(64, 96))
    x = mx.random.normal((2, 64))
    want = ffn(x)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(ffn, name, NativeQuantizedLinear.from_linear(getattr(ffn, name), 32, 4))
    assert type(ffn.gate_proj) is NativeQuantizedLinear and gated_product(x, ffn.gate_proj, ffn.up_proj) is not None
    separate = ffn.down_proj(nn.silu(ffn.gate_proj(x)) * ffn.up_proj(x))
    assert mx.abs(ffn(x) - separate).max().item() < 1e-5 and mx.abs(ffn(x) - want).max().item() < 0.1
    assert gated_product(x, ffn.gate_proj, nn.Linear(64, 96, bias=False)) is None


@pytest.mark.parametrize("rows", [1, 5, 32, 37, 130])
@pytest.mark.parametrize("out_dims, in_dims", [(64, 7), (577, 33), (192, 576), (96, 1536)])
def test_float_product_equals_mlx(rows, out_dims, in_dims):
    """Rows that fill the 32-row panels and rows that leave one padded, weight rows in whole tiles and not."""
    mx.random.seed(rows + out_dims)
    x, w = mx.random.normal((rows, in_dims)), mx.random.normal((out_dims, in_dims))
    assert_float32_close(minimlx_native.matmul(x, w), x @ w.T, x, w)


def test_float_product_of_batched_and_strided_inputs():
    mx.random.seed(1)
    x, w = mx.random.normal((3, 40, 96)), mx.random.normal((80, 96))
    assert_float32_close(minimlx_native.matmul(x, w), x @ w.T, x, w)
    strided = x.transpose(1, 0, 2)  # (40, 3, 96), rows not in memory order
    assert_float32_close(minimlx_native.matmul(strided, w), strided @ w.T, strided, w)


@pytest.mark.parametrize("rows", [3, 50])
def test_float_swiglu_product_equals_its_parts(rows):
    mx.random.seed(rows)
    x, gate, up = mx.random.normal((rows, 64)), mx.random.normal((200, 64)) * 0.3, mx.random.normal((200, 64))
    g = x @ gate.T
    want = g * mx.sigmoid(g) * (x @ up.T)
    got = minimlx_native.matmul_swiglu(x, gate, up)
    assert got.shape == want.shape and mx.abs(got - want).max().item() < 1e-4


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype, message",
    [
        ((4, 8), (5, 9), mx.float32, "features"),
        ((4, 0), (5, 0), mx.float32, "at least one"),
        ((4, 8), (5, 8), mx.float16, "float32"),
        ((4, 8), (8,), mx.float32, "float32"),
    ],
)
def test_float_product_refuses_what_it_does_not_read(x_shape, w_shape, dtype, message):
    with pytest.raises(ValueError, match=message):
        minimlx_native.matmul(mx.zeros(x_shape), mx.zeros(w_shape, dtype=dtype))
    with pytest.raises(ValueError, match="one shape"):
        minimlx_native.matmul_swiglu(mx.zeros((4, 8)), mx.zeros((5, 8)), mx.zeros((6, 8)))


def test_linear_maps_take_the_native_product_for_many_rows(monkeypatch):
    """A model's plain linear maps take the native form (its own arrays, not copies); a prompt's rows go to the
    kernel, a decode step's row to MLX, both equal to `nn.Linear`, bias included; a SwiGLU of two of them fuses."""
    mx.random.seed(2)
    ffn = SwiGLU(64, 96)
    ffn.up_proj = nn.Linear(64, 96, bias=True)
    plain = {name: getattr(ffn, name) for name in ("gate_proj", "up_proj", "down_proj")}
    x = mx.random.normal((NATIVE_ROWS + 3, 64))
    inputs = {"gate_proj": x, "up_proj": x, "down_proj": mx.random.normal((NATIVE_ROWS + 3, 96))}
    want = {name: linear(inputs[name]) for name, linear in plain.items()}
    use_cpu_forms(ffn)
    assert all(type(getattr(ffn, name)) is NativeLinear for name in plain)
    assert ffn.gate_proj.weight is plain["gate_proj"].weight and "bias" in ffn.up_proj
    calls = []
    monkeypatch.setattr(minimlx_native, "matmul", lambda *a, f=minimlx_native.matmul: calls.append(1) or f(*a))
    for name, linear in plain.items():
        assert_float32_close(getattr(ffn, name)(inputs[name]), want[name], inputs[name], linear.weight)
    assert len(calls) == 3
    assert mx.allclose(ffn.gate_proj(x[:1]), want["gate_proj"][:1]).item() and len(calls) == 3
    assert gated_product(x, ffn.gate_proj, ffn.up_proj) is None  # up has a bias
    ffn.up_proj = NativeLinear(64, 96, bias=False)
    g = ffn.gate_proj(x)
    assert mx.abs(gated_product(x, ffn.gate_proj, ffn.up_proj) - g * mx.sigmoid(g) * ffn.up_proj(x)).max().item() < 1e-4
    assert gated_product(x[:1], ffn.gate_proj, ffn.up_proj) is None


@pytest.mark.parametrize("shape", [(3, 7, 576), (1, 64)])
def test_rms_norm_equals_mlx(shape):
    x, weight = mx.random.normal(shape) * 5, mx.random.normal((shape[-1],))
    want = mx.fast.rms_norm(x, weight, 1e-6)
    assert mx.abs(minimlx_native.rms_norm(x, weight, 1e-6) - want).max().item() < 1e-5
    strided = x.swapaxes(0, -2)
    assert mx.abs(minimlx_native.rms_norm(strided, weight, 1e-6) - mx.fast.rms_norm(strided, weight, 1e-6)).max() < 1e-5
    every_other = mx.repeat(weight[:, None], 2, axis=1)[:, 0]  # a view with a stride of 2
    assert mx.abs(minimlx_native.rms_norm(x, every_other, 1e-6) - want).max().item() < 1e-5
    with pytest.raises(ValueError, match="weight float32"):
        minimlx_native.rms_norm(x, weight[:-1], 1e-6)


@pytest.mark.parametrize("dims, head_dim, traditional", [(64, 64, False), (32, 64, True), (64, 128, False)])
@pytest.mark.parametrize("position", [0, 77, 4000])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotate_equals_mlx_rope(dims, head_dim, traditional, position, tokens):
    """One position's angles for every row, or one row of angles per token; queries handed in as the
    transposed view the attention makes of them."""
    x = mx.random.normal((2, tokens, 9, head_dim)).transpose(0, 2, 1, 3)
    wavelengths = 10000.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    angles = (position + mx.arange(tokens, dtype=mx.float32))[:, None] / wavelengths
    angles = angles[0] if tokens == 1 else angles
    got = minimlx_native.rotate(x, mx.cos(angles), mx.sin(angles), dims, traditional)
    want = mx.fast.rope(x, dims, traditional=traditional, base=None, scale=1.0, offset=position, freqs=wavelengths)
    assert got.shape == want.shape and mx.abs(got - want).max().item() < 1e-6 * max(1, position) + 1e-5
    pairs = mx.repeat(angles[..., None], 2, axis=-1)  # angles handed in as views with a stride of 2
    got = minimlx_native.rotate(x, mx.cos(pairs)[..., 0], mx.sin(pairs)[..., 0], dims, traditional)
    assert mx.abs(got - want).max().item() < 1e-6 * max(1, position) + 1e-5
    with pytest.raises(ValueError, match="dims even"):
        minimlx_native.rotate(x, mx.cos(angles), mx.sin(angles), dims + 1, traditional)
    with pytest.raises(ValueError, match="dims even"):
        minimlx_native.rotate(
            x, mx.zeros((tokens + 1, dims // 2)), mx.zeros((tokens + 1, dims // 2)), dims, traditional
        )


@pytest.mark.parametrize("tokens", [1, 4])
def test_rotate_rows_at_their_own_positions(monkeypatch, tokens):
    """Rows of a padded batch each at its own position (angles per batch row), as `mx.fast.rope` with an array
    offset rotates them; and RoPE's CPU path, native or spelled out, the same."""
    x = mx.random.normal((3, 9, tokens, 64))
    offsets = mx.array([5, 17, 300])
    wavelengths = 10000.0 ** (mx.arange(0, 64, 2, dtype=mx.float32) / 64)
    angles = (offsets[:, None] + mx.arange(tokens)).astype(mx.float32)[..., None] / wavelengths
    got = minimlx_native.rotate(x, mx.cos(angles), mx.sin(angles), 64, False)
    want = mx.fast.rope(x, 64, traditional=False, base=None, scale=1.0, offset=offsets, freqs=wavelengths)
    assert mx.abs(got - want).max().item() < 3e-4
    rope = CpuRoPE(64)
    rotated = rope(x, offsets)
    assert mx.abs(rotated - want).max().item() < 3e-4
    monkeypatch.setattr(native, "kernel", None)
    assert mx.abs(rope(x, offsets) - rotated).max().item() < 1e-6


@pytest.mark.slow
def test_minimlx_native_off_keeps_the_kernel_out():
    """The kernel is probed once, at import: MINIMLX_NATIVE=off then leaves every CPU form on MLX's ops."""
    import subprocess
    import sys

    code = "import minimlx; from minimlx.cpu import native; print(native.kernel is None, minimlx.load.__name__)"
    environ = {**os.environ, "MINIMLX_NATIVE": "off"}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "load"]
