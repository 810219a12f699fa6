"""KV caches held in 8 and 4 bits (`QuantizedKVCache`, `--kv-bits`): their bytes, the attention that reads them
(plain MLX and the native kernel against each other), and SmolLM2's logits and greedy ids against a float32 cache."""

import mlx.core as mx
import pytest

from minimlx.core.attention import quantized_attention
from minimlx.core.cache import KVCache, QuantizedKVCache, visible
from minimlx.cpu import native
from minimlx.decode import SamplingSettings, batch_generate, generate, generate_tokens, make_cache

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue in two sentences.",
]


def filled(cache, tokens: int, kv_heads: int = 3, head_dim: int = 64):
    mx.random.seed(0)
    keys, values = (mx.random.normal((1, kv_heads, tokens, head_dim)) for _ in range(2))
    cache.update(keys, values)
    mx.eval(cache.state)
    return cache


def test_an_8_bit_cache_of_4k_tokens_holds_under_0_3_of_float32s_bytes():
    ratio = filled(QuantizedKVCache(8), 4096).nbytes / filled(KVCache(), 4096).nbytes
    assert ratio == pytest.approx((64 + 2 * 4) / (4 * 64))  # codes + a float32 scale and bias per 64 features
    assert ratio <= 0.3
    assert filled(QuantizedKVCache(4), 4096).nbytes / filled(KVCache(), 4096).nbytes == pytest.approx(0.15625)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_attention_is_attention_over_the_dequantized_cache(bits):
    cache = filled(QuantizedKVCache(bits), 40)
    q = mx.random.normal((1, 9, 5, 64))
    k, v = cache.update(mx.random.normal((1, 3, 5, 64)), mx.random.normal((1, 3, 5, 64)))
    keys, values = cache.dequantize(k), cache.dequantize(v)
    expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask="causal")
    assert mx.abs(quantized_attention(q, k, v, 0.125, "causal", 64, bits) - expected).max().item() < 1e-5


@pytest.mark.skipif(native.kernel is None, reason="the native kernel is not installed")
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, queries, keys, head_dim, group_size",
    [
        (1, 9, 3, 1, 300, 64, 64),
        (2, 8, 2, 5, 40, 128, 64),
        (1, 4, 4, 17, 17, 64, 32),
        (1, 9, 3, 33, 70, 96, 32),
        (1, 9, 3, 1, 4100, 64, 64),
        (2, 8, 2, 3, 1200, 128, 32),
    ],
)
def test_the_native_kernel_reads_the_codes_as_mlx_does(
    bits, batch, heads, kv_heads, queries, keys, head_dim, group_size
):
    mx.random.seed(1)
    q = mx.random.normal((batch, heads, queries, head_dim))
    # slices of longer buffers, as a cache hands them over
    k, v = (mx.random.normal((batch, kv_heads, keys + 7, head_dim))[:, :, :keys] for _ in range(2))
    k, v = mx.quantize(k, group_size=group_size, bits=bits), mx.quantize(v, group_size=group_size, bits=bits)
    scale = head_dim**-0.5
    causal = quantized_attention(q, k, v, scale, "causal" if queries > 1 else None, group_size, bits)
    out = native.kernel.quantized_attention(q, *k, *v, scale, group_size, bits)
    assert mx.abs(out - causal).max().item() < 1e-5
    shown = (mx.random.uniform(shape=(batch, 1, queries, keys)) > 0.3) | (mx.arange(keys) == 0)  # none sees nothing
    masked = quantized_attention(q, k, v, scale, shown & visible(0, keys - queries, queries), group_size, bits)
    out = native.kernel.quantized_attention(q, *k, *v, scale, group_size, bits, shown)
    assert mx.abs(out - masked).max().item() < 1e-5


@pytest.mark.slow
def test_smollm2_logits_over_an_8_bit_cache_stay_near_float32s(smollm2):
    model, tokenizer = smollm2
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    float_ids = [list(generate_tokens(model, p, make_cache(model), SamplingSettings(max_tokens=64))) for p in ids]
    for prompt, answer in zip(ids, float_ids):
        text = mx.array([prompt + answer])
        reference = model(text, [KVCache() for _ in model.layers])[0, len(prompt) - 1 : -1]
        logits = model(text, [QuantizedKVCache(8) for _ in model.layers])[0, len(prompt) - 1 : -1]
        assert mx.abs(logits - reference).max().item() < 1.0  # measured 0.43-0.75; logits span about +-30
        # teacher-forced on float32's greedy answer: the same top token nearly everywhere
        assert (logits.argmax(-1) == mx.array(answer)).mean().item() >= 0.95


@pytest.mark.slow
def test_batched_and_plain_decoding_over_8_bit_caches_give_the_same_ids(smollm2):
    model, tokenizer = smollm2
    plain = [generate(model, tokenizer, p, chat_template=False, max_tokens=24, kv_bits=8) for p in PROMPTS]
    assert batch_generate(model, tokenizer, PROMPTS, chat_template=False, max_tokens=24, kv_bits=8) == plain
