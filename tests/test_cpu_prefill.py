"""The CPU prefill paths (`cpu.elementwise`, `cpu.attention.causal_attention`) against MLX's own ops and float64."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from models import chat_ids, greedy_ids

import minimlx.cpu.attention as attention
from minimlx.cpu import elementwise
from minimlx.cpu.attention import causal_attention


def test_exp_is_within_about_one_ulp_of_float64():
    x = np.linspace(-87, 88.3, 200_001, dtype=np.float32)
    exact = np.exp(x.astype(np.float64))
    ours = np.array(elementwise.exp(mx.array(x))).astype(np.float64)
    assert np.max(np.abs(ours - exact) / exact) < 2e-7
    edges = elementwise.exp(mx.array([-math.inf, -100.0, 0.0, 1.0, 100.0, math.inf])).tolist()
    assert edges[:3] == [0.0, 0.0, 1.0] and edges[3] == pytest.approx(math.e, rel=1e-7)
    assert edges[4:] == [math.inf, math.inf]


def test_silu_and_softmax_match_mlx():
    x = mx.random.normal((3, 1536), key=mx.random.key(0)) * 8
    assert mx.allclose(elementwise.silu(x), nn.silu(x), rtol=1e-6, atol=1e-6)
    scores = mx.random.normal((4, 100), key=mx.random.key(2)) * 10
    scores = mx.where(mx.arange(100) > 60, -math.inf, scores)
    weights = elementwise.softmax(scores)
    assert mx.allclose(weights, mx.softmax(scores, axis=-1, precise=True), rtol=1e-6, atol=1e-7)
    assert mx.all(weights[:, 61:] == 0).item()


@pytest.mark.parametrize(
    "heads, kv_heads, queries, past", [(9, 3, 128, 0), (9, 3, 130, 70), (4, 4, 65, 0), (6, 1, 1, 9)]
)
def test_causal_attention_matches_mlx(heads, kv_heads, queries, past):
    """Blocks of 64 queries (the last one partial), grouped heads, a chunk that continues a cache."""
    keys = [mx.random.key(i) for i in range(3)]
    q = mx.random.normal((2, heads, queries, 64), key=keys[0])
    k, v = (mx.random.normal((2, kv_heads, past + queries, 64), key=key) for key in keys[1:])
    mask = "causal" if queries > 1 else None
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(causal_attention(q, k, v, 0.125), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_greedy_ids_unchanged_on_smollm2(smollm2, monkeypatch):
    """A 200-token prompt (4 attention blocks, two prefill chunks of 128): the same 12 greedy tokens with MLX's
    attention and silu as with minimlx's CPU paths."""
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "Summarise the history of Paris in detail. " * 20)[:200]
    ours = greedy_ids(model, tokenizer, ids, max_tokens=12, prefill_step=128)
    monkeypatch.setattr(
        attention,
        "attend",
        lambda q, k, v, scale, mask, sinks=None: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks
        ),
    )
    monkeypatch.setattr(elementwise, "silu", nn.silu)  # what the model's silu calls (bound when it was built)
    assert greedy_ids(model, tokenizer, ids, max_tokens=12, prefill_step=128) == ours


@pytest.mark.slow
def test_mkl_threads_sleep_between_products():
    """Spinning OpenMP threads starve the working one on a busy machine (27-36 s prefills instead of 0.6-0.9 s)."""
    import os
    import subprocess
    import sys

    code = "import os, minimlx.cpu.blas as b; print(b.loaded or '', os.environ.get('OMP_WAIT_POLICY', ''))"
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "MINIMLX_BLAS")}
    loaded, policy = (
        subprocess.run(
            [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
        ).stdout.split()
        + ["", ""]
    )[:2]
    if "mkl" not in loaded:
        pytest.skip("MKL is not the BLAS minimlx loads here")
    assert policy == "PASSIVE"
