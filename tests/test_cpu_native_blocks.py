"""The native kernel's products with GGUF's Q4_K, Q5_K, Q6_K and Q8_0 weights held as the file stores them: rows
against gguf's own dequantization of blocks from ggml's quantizer, products against float32 ones, the integer
products within the rounding of their 8-bit inputs, and a Q4_K_M file loaded and decoded through them."""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from llamacpp import ggml_quantize
from native_checks import fused_and_alone, integer_against_float, per_instruction_set

if os.environ.get("CI"):  # CI installs the kernel (.ci/run): missing there is a failure
    import minimlx_native
else:
    minimlx_native = pytest.importorskip(
        "minimlx_native", reason="the native kernel is not installed (pip install -v -e . says why)"
    )

from minimlx import load  # noqa: E402
from minimlx.archs.gguf import unpacked  # noqa: E402
from minimlx.core import Experts, MoE, Router, SwiGLU  # noqa: E402
from minimlx.cpu import native  # noqa: E402
from minimlx.cpu.forms import NativeMoE, moe_parts, use_cpu_forms  # noqa: E402
from minimlx.cpu.linear import (  # noqa: E402
    GEMM_ROWS,
    BlockExpertsByOps,
    BlockLinearByOps,
    NativeBlockEmbedding,
    NativeBlockExperts,
    NativeBlockLinear,
)
from minimlx.errors import CheckpointError  # noqa: E402
from minimlx.io.gguf_file import nbytes, open_gguf  # noqa: E402
from minimlx.loading import stored_blocks  # noqa: E402
from minimlx.quantization import dequantize_stored  # noqa: E402
from minimlx.tune.train import differentiable  # noqa: E402

TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0]


def blocks_of(kind: T, rows: int, cols: int, seed: int) -> tuple[mx.array, mx.array]:
    """A random (rows, cols) weight quantized by ggml's reference quantizer: its blocks and gguf's float32 values."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = ggml_quantize(kind, w)
    return mx.array(blocks), mx.array(dequantize(blocks, kind).astype(np.float32))


def q8_inputs(x: mx.array) -> tuple[mx.array, mx.array]:
    """x as the integer products quantize it (per block of 32: d = max |x| / 127, codes round(x / d), to nearest even),
    and each value's d."""
    blocks = np.array(x).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inverse)
    return mx.array((codes * d).reshape(x.shape)), mx.array(np.broadcast_to(d, blocks.shape).reshape(x.shape))


@pytest.mark.parametrize("kind", TYPES)
def test_rows_are_ggufs_dequantization(kind):
    blocks, weight = blocks_of(kind, 24, 512, seed=1)
    ids = mx.array([[3, 0], [23, 7]])
    assert mx.array_equal(minimlx_native.block_rows(blocks, ids, int(kind)), weight[ids]).item()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 30])
def test_exact_product_equals_the_float32_product(kind, rows):
    """`exact` (and 28 rows or more, a prompt's products): x @ W.T from the dequantized rows, to float32 rounding."""
    blocks, weight = blocks_of(kind, 40, 768, seed=2)
    x = mx.random.normal((rows, 768), key=mx.random.key(rows))
    got = minimlx_native.block_matmul(x, blocks, int(kind), exact=True)
    bound = mx.abs(x) @ mx.abs(weight).T
    assert mx.all(mx.abs(got - x @ weight.T) <= 1e-5 * bound).item()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 4, 27])
def test_integer_product_is_the_product_of_q8_inputs(kind, rows):
    """Fewer than 28 rows take the integer products: x quantized per block of 32 (as llama.cpp's Q8_0 activations;
    its K-quant products take Q8_K's one step per 256 values) times the stored codes, which is the float32 product of
    those inputs to float32 rounding. Its error against float32 inputs is that of the inputs' rounding, at most half a
    step per value: |error| <= sum_k |w_k| d_k / 2, the bound llama.cpp's own products meet with d_k its Q8_K step
    (the largest |x| of the 256 values around k over 127, at least this one's). Every row as it is alone."""
    blocks, weight = blocks_of(kind, 72, 1024, seed=3)
    x = mx.random.normal((rows, 1024), key=mx.random.key(10 + rows))
    x = x * mx.where(mx.arange(1024) % 97 == 5, 20.0, 1.0)  # outlier channels, as a norm's weights make them
    got = minimlx_native.block_matmul(x, blocks, int(kind))
    value, d = q8_inputs(x)
    assert mx.all(mx.abs(got - value @ weight.T) <= 1e-5 * (mx.abs(value) @ mx.abs(weight).T)).item()
    exact = minimlx_native.block_matmul(x, blocks, int(kind), exact=True)
    assert mx.all(mx.abs(got - exact) <= (d / 2) @ mx.abs(weight).T * 1.001 + 1e-4).item()
    alone = mx.concatenate([minimlx_native.block_matmul(x[i : i + 1], blocks, int(kind)) for i in range(rows)])
    assert mx.array_equal(got, alone).item()


@pytest.mark.parametrize("kind", TYPES)
def test_prompt_product_is_the_product_of_q8_inputs(kind):
    """A prompt's products (`prompt`, the integer GEMM where the CPU has one) take the inputs as the integer products
    do: the float32 product of those inputs to float32 rounding, each row as it is alone (a prompt's rows come out the
    same however it is chunked into parts of 8 rows or more), and 40 weight rows (a tile of 32 and a part of one);
    fewer rows take the decode steps' integer products."""
    blocks, weight = blocks_of(kind, 40, 1024, seed=6)
    x = mx.random.normal((21, 1024), key=mx.random.key(6)) * mx.where(mx.arange(1024) % 97 == 5, 20.0, 1.0)
    got = minimlx_native.block_matmul(x, blocks, int(kind), prompt=True)
    value, _ = q8_inputs(x)
    assert mx.all(mx.abs(got - value @ weight.T) <= 1e-5 * (mx.abs(value) @ mx.abs(weight).T)).item()
    chunks = [minimlx_native.block_matmul(x[a:b], blocks, int(kind), prompt=True) for a, b in ((0, 8), (8, 21))]
    assert mx.array_equal(got, mx.concatenate(chunks)).item()
    few = minimlx_native.block_matmul(x[:3], blocks, int(kind), prompt=True)
    assert mx.array_equal(few, minimlx_native.block_matmul(x[:3], blocks, int(kind))).item()


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K])
def test_gathered_product_is_each_rows_experts_product(kind):
    """Stacked experts held as GGUF blocks: each row times its expert's weight, runs of one expert computed as one
    product of their rows (float32 with `exact`; the integer products or, from 8 rows in a prompt, the integer GEMM:
    the product of the 8-bit inputs), an expert outside the stack giving zeros."""
    pieces = [blocks_of(kind, 40, 512, seed=20 + e) for e in range(3)]
    blocks, weight = mx.stack([b for b, _ in pieces]), mx.stack([w for _, w in pieces])
    ids = mx.array([2, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 7, 2], dtype=mx.int32)
    x = mx.random.normal((ids.size, 512), key=mx.random.key(9))
    chosen = weight[mx.minimum(ids, 2)]
    value, _ = q8_inputs(x)
    for kwargs, inputs in (({"exact": True}, x), ({}, value), ({"prompt": True}, value)):
        got = minimlx_native.block_gather_matmul(x, blocks, int(kind), ids, **kwargs)
        want = (chosen @ inputs[:, :, None])[:, :, 0] * (ids < 3)[:, None]
        bound = (mx.abs(chosen) @ mx.abs(inputs)[:, :, None])[:, :, 0]
        assert mx.all(mx.abs(got - want) <= 1e-5 * bound + 1e-6).item(), kwargs
    alone = mx.concatenate([minimlx_native.block_matmul(x[i : i + 1], blocks[int(ids[i])], int(kind)) for i in (1, 2)])
    assert mx.array_equal(minimlx_native.block_gather_matmul(x, blocks, int(kind), ids)[1:3], alone).item()


def block_moe_of(sigmoid: bool, shared: bool) -> MoE:
    """A mixture of 8 experts (3 a token) of width 256 in its native forms, held as GGUF blocks (Q4_K gate and up,
    Q6_K down): DeepSeek's sigmoid routing with a score bias, renormalised and scaled, and a shared expert; or a
    softmax router alone."""
    dims, hidden, count = 256, 256, 8
    router = Router(dims, count, 3, "sigmoid" if sigmoid else "softmax", sigmoid, score_bias=sigmoid, scale=2.5)
    moe = use_cpu_forms(MoE(router, Experts(dims, hidden, count), SwiGLU(dims, hidden) if shared else None))
    moe.router.proj.weight = mx.random.normal((count, dims), key=mx.random.key(4)) / 16
    if sigmoid:
        moe.router.score_bias = mx.random.normal((count,), key=mx.random.key(5)) / 8
    for i, (name, kind) in enumerate((("gate_proj", T.Q4_K), ("up_proj", T.Q4_K), ("down_proj", T.Q6_K))):
        stacked = NativeBlockExperts(count, hidden if name != "down_proj" else dims, 256, kind.name.lower())
        stacked.weight = mx.stack([blocks_of(kind, 256, 256, seed=10 * i + e)[0] for e in range(count)])
        setattr(moe.experts, name, stacked)
        if shared:
            linear = NativeBlockLinear(256, 256, kind.name.lower())
            linear.weight = blocks_of(kind, 256, 256, seed=90 + i)[0]
            setattr(moe.shared_experts, name, linear)
    return moe


@pytest.mark.parametrize("sigmoid", [True, False])
@pytest.mark.parametrize("exact", [False, True])
def test_mixture_step_is_its_ops(sigmoid, exact, monkeypatch):
    """`block_moe`, a few rows' mixture of experts as one op (routing, the chosen experts' SwiGLU products, their
    weighted sum, the shared expert), gives what the mixture's MLX ops give over the same stored blocks: each row
    quantized once for all its experts is what quantizing it once per expert gives."""
    moe = block_moe_of(sigmoid, shared=sigmoid)
    assert type(moe) is NativeMoE and moe_parts(moe) is not None
    monkeypatch.setattr(native, "exact_products", exact)
    x = mx.random.normal((2, 1, 256), key=mx.random.key(6))
    got, want = moe(x), MoE.__call__(moe, x)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    assert mx.array_equal(moe(x[1:]), got[1:]).item()  # a row gets what it gets alone


@pytest.mark.parametrize(("exact", "prompt"), [(False, False), (True, False), (False, True)])
def test_swiglu_product_equals_its_parts(exact, prompt):
    """The gated product of a Q4_K gate and a Q6_K up (as a Q4_K_M file may hold them)."""
    (gate, _), (up, _) = blocks_of(T.Q4_K, 64, 512, seed=4), blocks_of(T.Q6_K, 64, 512, seed=5)
    x = mx.random.normal((2, 512), key=mx.random.key(0))
    g = minimlx_native.block_matmul(x, gate, int(T.Q4_K), exact=exact, prompt=prompt)
    want = g * mx.sigmoid(g) * minimlx_native.block_matmul(x, up, int(T.Q6_K), exact=exact, prompt=prompt)
    got = minimlx_native.block_swiglu(x, gate, int(T.Q4_K), up, int(T.Q6_K), exact=exact, prompt=prompt)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


@pytest.mark.parametrize("exact", [False, True])
def test_geglu_product_equals_its_parts(exact):
    """Gemma's gated product, gelu_approx(x @ gate.T) * (x @ up.T), in one op for a decode step's few rows; its gate
    alone (`geglu`) for a prompt's."""
    (gate, _), (up, _) = blocks_of(T.Q4_K, 64, 512, seed=4), blocks_of(T.Q6_K, 64, 512, seed=5)
    x = mx.random.normal((3, 512), key=mx.random.key(0))
    g = minimlx_native.block_matmul(x, gate, int(T.Q4_K), exact=exact)
    want = nn.gelu_approx(g) * minimlx_native.block_matmul(x, up, int(T.Q6_K), exact=exact)
    got = minimlx_native.block_geglu(x, gate, int(T.Q4_K), up, int(T.Q6_K), exact=exact)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    gated = minimlx_native.geglu(g, minimlx_native.block_matmul(x, up, int(T.Q6_K), exact=exact))  # a prompt's gate
    assert mx.abs(gated - want).max().item() <= 1e-6 * mx.abs(want).max().item()


@pytest.mark.parametrize("exact", [False, True])
def test_layer_input_step_equals_its_parts(exact):
    """Gemma 4's per-layer input after a block, (h + rms_norm(proj(gelu_approx(gate(h)) * own)) * w) * scalar, in one
    op for a decode step's few rows, with the layer's own inputs read through a strided view."""
    (gate, _), (proj, _) = blocks_of(T.Q4_K, 256, 512, seed=7), blocks_of(T.Q4_K, 512, 256, seed=8)
    h = mx.random.normal((2, 1, 512), key=mx.random.key(1))
    own = mx.random.normal((2, 1, 3, 256), key=mx.random.key(2))[:, :, 1]
    weight, scalar = mx.random.normal((512,), key=mx.random.key(3)), mx.array([0.7])
    gated = nn.gelu_approx(minimlx_native.block_matmul(h, gate, int(T.Q4_K), exact=exact)) * own
    projected = minimlx_native.block_matmul(gated, proj, int(T.Q4_K), exact=exact)
    want = (h + mx.fast.rms_norm(projected, weight, 1e-6)) * scalar
    got = minimlx_native.block_layer_input(h, gate, int(T.Q4_K), proj, int(T.Q4_K), own, weight, 1e-6, scalar, exact)
    assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_refuses_what_it_does_not_read():
    blocks, _ = blocks_of(T.Q4_K, 8, 512, seed=6)
    with pytest.raises(ValueError, match="type 2 is none of"):
        minimlx_native.block_matmul(mx.zeros((1, 512)), blocks, 2)
    with pytest.raises(ValueError, match="features other than x's 256"):
        minimlx_native.block_matmul(mx.zeros((1, 256)), blocks, int(T.Q4_K))
    with pytest.raises(ValueError, match="whole blocks of its type"):
        minimlx_native.block_matmul(mx.zeros((1, 512)), blocks[:, :100], int(T.Q4_K))


INSTRUCTION_SETS = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512vnni"}


@pytest.mark.slow  # starts a Python process per instruction set
def test_every_instruction_set_gives_the_portable_products(tmp_path):
    """MINIMLX_NATIVE_ISA caps the instruction set: AVX2's maddubs and AVX-512 VNNI's vpdpbusd give the scalar code's
    integer products, but for the order of the float32 sums of the sub-blocks."""
    program = (
        "import sys\nimport numpy as np\nimport minimlx\nimport mlx.core as mx\nimport minimlx_native as k\n"
        "x = mx.random.normal((3, 512), key=mx.random.key(0))\nout = {}\n"
        "for kind in (8, 12, 13, 14):\n"
        "    w = mx.array(np.load(sys.argv[2] + f'/{kind}.npy'))\n"
        "    out[str(kind)] = k.block_matmul(x, w, kind)\n"
        "mx.savez(sys.argv[1], **out)\nprint(k.block_isa)\n"
    )
    bounds = {}
    for kind in TYPES:
        blocks, weight = blocks_of(kind, 40, 512, seed=7)
        np.save(tmp_path / f"{int(kind)}.npy", np.array(blocks))
        bounds[str(int(kind))] = mx.abs(mx.random.normal((3, 512), key=mx.random.key(0))) @ mx.abs(weight).T
    results = per_instruction_set(program, INSTRUCTION_SETS, tmp_path, str(tmp_path))
    reference = results.pop("scalar")
    for isa, got in results.items():
        for key in reference:
            assert mx.all(mx.abs(got[key] - reference[key]) <= 1e-6 * bounds[key]).item(), (isa, key)


def test_stored_only_on_the_cpu_where_packed_weights_stay_packed():
    assert stored_blocks(None) == stored_blocks("quantized") == {int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)}
    assert stored_blocks("float32") == frozenset()


@pytest.fixture(scope="module")
def q4_k_m(kquant_llama):
    return kquant_llama["Q4_K_M"]


def test_a_q4_k_m_file_is_held_as_stored(q4_k_m):
    """Every K-quant matrix stays in its blocks, the embedding and the head included: the weights held are the file's
    tensor bytes."""
    model, _ = load(q4_k_m)
    file = open_gguf(q4_k_m)
    modules = {path: m for path, m in model.named_modules() if isinstance(m, (NativeBlockLinear, NativeBlockEmbedding))}
    assert type(model.embed) is NativeBlockEmbedding and "layers.0.ffn.down_proj" in modules
    assert {m.mode for m in modules.values()} == {"q4_k", "q6_k"}
    file_bytes = sum(
        int(np.prod(shape)) // 256 * {T.Q4_K: 144, T.Q6_K: 210}[kind]
        for kind, shape, _ in file.tensors.values()
        if kind in (T.Q4_K, T.Q6_K)
    )
    assert sum(m.weight.nbytes for m in modules.values()) == file_bytes


def test_q4_k_m_prompt_logits_equal_the_dequantized_models(q4_k_m):
    """A prompt's products of at least GEMM_ROWS rows dequantize the stored rows for the float32 GEMM: the logits of the
    float32 model. Shorter prompts take the integer products, as decode steps do."""
    ids = mx.array([list(range(1, 1 + 2 * GEMM_ROWS, 2))])
    stored, _ = load(q4_k_m)
    dequantized, _ = load(q4_k_m, dtype="float32")
    want = dequantized(ids)
    assert mx.abs(stored(ids) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
    short = stored(ids[:, :8])
    assert 0 < mx.abs(short - want[:, :8]).max().item() <= 0.2 * mx.abs(want).max().item()


def test_a_mixture_of_experts_file_keeps_its_experts_stored(kquant_moe, monkeypatch):
    """A Q4_K_M mixture of experts holds its stacked experts as the file's blocks (`NativeBlockExperts`), their bytes
    the file's, and gives the dequantized model's logits with float32 inputs; the integer products stay near them."""
    path = kquant_moe["Q4_K_M"]
    model, _ = load(path)
    experts = {p: m for p, m in model.named_modules() if type(m) is NativeBlockExperts}
    assert {p.rsplit(".", 1)[-1] for p in experts} == {"gate_proj", "up_proj", "down_proj"}
    file = open_gguf(path)
    stored = sum(nbytes(kind, shape) for name, (kind, shape, _) in file.tensors.items() if "_exps." in name)
    assert sum(m.weight.nbytes for m in experts.values()) == stored
    ids = mx.array([list(range(1, 80, 2))])
    dequantized, _ = load(path, dtype="float32")
    want = dequantized(ids)
    monkeypatch.setattr(native, "exact_products", True)
    assert mx.abs(model(ids) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
    monkeypatch.setattr(native, "exact_products", False)
    assert 0 < mx.abs(model(ids[:, :8]) - want[:, :8]).max().item() <= 0.2 * mx.abs(want).max().item()
    differentiable(model)  # training's forms: the experts dequantized by MLX ops, with gradients to their inputs
    assert type(model.layers[0].ffn.experts.up_proj) is BlockExpertsByOps
    assert mx.abs(model(ids) - want).max().item() <= 1e-4 * mx.abs(want).max().item()


def test_q4_k_m_integer_decoding_follows_the_float_path(q4_k_m, monkeypatch):
    """Decoding the tiny random Q4_K_M llama greedily with float32 inputs, the integer products' logits at each step
    (fed the same tokens) stay within 2.0 of the float path's (logits of magnitude ~10; 1.35 at most measured) and
    their greedy ids agree on at least 232 of 256 (241 measured; round three's products over this file's affine
    re-packing: 244). Random weights leave the largest logits close together, and its down projection's inputs are
    heavy-tailed (largest |x| 51 at a mean of 3), so 8-bit inputs tip more of its choices than a trained model's."""
    model, _ = load(q4_k_m)
    agree, largest = integer_against_float(model, mx.array([[1, 5, 9, 20, 33, 7, 100, 3]]), 256, monkeypatch)
    assert agree >= 232 and 0 < largest <= 2.0


@pytest.mark.parametrize("exact", [False, True])
def test_q4_k_m_fused_decode_step_gives_the_bits_of_its_ops(q4_k_m, monkeypatch, exact):
    """The compiled step runs a block whose projections are held as GGUF blocks (Q4_K and Q6_K, as this Q4_K_M file
    mixes them) as one `block_step`: its logits over 8 greedy steps have exactly the bits of the same step with every
    part as its own op, with integer products and with float32 inputs."""
    model, _ = load(q4_k_m)
    monkeypatch.setattr(native, "exact_products", exact)
    fused, alone, fused_calls, _ = fused_and_alone(model, mx.array([[1, 5, 9, 20, 33, 7]]), 8, monkeypatch)
    assert fused_calls == len(model.layers)  # once per layer, as the step is traced
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused, alone))


def test_mixture_decode_step_gives_the_bits_of_its_ops(kquant_moe, monkeypatch):
    """A block whose feed-forward is a mixture that `block_moe` computes runs its attention's half as one `block_step`
    (q, k and v biases added there, as GLM-4.5's are), then the mixture's one op: the compiled step's logits over 6
    greedy steps have exactly the bits of the same step with every part of the attention as its own op."""
    model, _ = load(kquant_moe["Q4_K_M"])
    for layer in model.layers:
        for i, proj in enumerate((layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj)):
            proj.bias = mx.random.normal((proj.weight.shape[0],), key=mx.random.key(i)) / 4
    fused, alone, fused_calls, _ = fused_and_alone(model, mx.array([[1, 5, 9, 20, 33, 7]]), 6, monkeypatch)
    assert type(model.layers[0].ffn) is NativeMoE and fused_calls == len(model.layers)
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused, alone))


def test_training_forms_have_gradients_and_the_same_logits(q4_k_m):
    """`tune.train.differentiable` puts the block modules in forms of MLX ops: gradients flow to the inputs (the
    stored blocks stay frozen), and a prompt's logits are those of the native forms' float32 GEMM."""
    model, _ = load(q4_k_m)
    ids = mx.array([list(range(1, 1 + 2 * GEMM_ROWS, 2))])
    want = model(ids)
    differentiable(model)
    assert type(model.layers[0].attn.q_proj) is BlockLinearByOps
    assert mx.abs(model(ids) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
    x = mx.random.normal((2, 256), key=mx.random.key(3))
    up = model.layers[0].ffn.up_proj
    grad = mx.grad(lambda x: (up(x) ** 2).sum())(x)
    weight = minimlx_native.block_rows(up.weight, mx.arange(up.weight.shape[0]), up.ggml_type)
    assert mx.allclose(grad, 2 * (x @ weight.T) @ weight, rtol=1e-4, atol=1e-4).item()


def test_layouts_reordered_along_columns_read_stored_blocks():
    """A plugin that transposes or re-orders a tensor's columns (DeepSeek's kv_b, Qwen3-Next's out_proj) reads stored
    blocks as gguf's float32 values: the type known from the columns, or from the row bytes alone where one fits."""
    blocks, weight = blocks_of(T.Q4_K, 16, 512, seed=8)
    assert mx.array_equal(unpacked({"a.weight": blocks}, "a.weight"), weight).item()
    assert mx.array_equal(dequantize_stored(blocks, 512), weight).item()
    with pytest.raises(CheckpointError, match="--dtype float32"):
        dequantize_stored(mx.zeros((2, 1584), mx.uint8))  # 11 Q4_K or 9 Q5_K super-blocks
