"""The 2025-26 families: olmo3, ministral3 (and mistral3's text model), glm4_moe, minimax_m2, ...

Each tiny random transformers model (every layer kind among its first layers, windows shorter than the 16 test
tokens) is saved, loaded by minimlx and compared on float32 logits: the whole sequence at once, token by token
through the cache from the start, and a 9-token prompt then single steps.
"""

import mlx.core as mx
import numpy as np
import pytest
from models import check_speculation_and_prompt_cache_files
from reference import cache_errors, random_ids, reference_logits, relative_error, require, save_reference

import minimlx
from minimlx.anatomy.ledger import ledger
from minimlx.archs import plugin_config
from minimlx.core import ChunkedKVCache, IndexedLatentCache, KVCache, MoE
from minimlx.errors import CheckpointError

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(  # the smallest vision tower: image-text checkpoints hold one, which minimlx skips
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
MINISTRAL3 = dict(
    BASE,
    head_dim=16,
    sliding_window=6,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=1000000.0,
        factor=16.0,
        original_max_position_embeddings=4,  # the query temperature rises every 4 positions
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        llama_4_scaling_beta=0.1,
    ),
)
MISTRAL4 = dict(
    BASE,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
    first_k_dense_replace=1,
    rope_parameters=dict(MINISTRAL3["rope_parameters"], rope_theta=10000.0, partial_rotary_factor=0.5),
)
LLAMA4 = dict(
    BASE,
    intermediate_size=32,
    intermediate_size_mlp=96,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,  # dense, MoE, dense, MoE
    no_rope_layers=[1, 1, 1, 0],  # the fourth layer: no RoPE, the whole text, the query temperature
    attention_chunk_size=4,  # four chunks in the 16 test tokens
    floor_scale=4,
    attn_scale=0.5,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)
CONFIGS = {
    "olmo3": (
        "Olmo3Config",
        dict(
            BASE,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=500000.0),
            ),
        ),
    ),
    "ministral3": ("Ministral3Config", MINISTRAL3),
    "mistral3": (
        "Mistral3Config",
        dict(
            text_config=dict(MINISTRAL3, model_type="ministral3"),
            vision_config=dict(VISION, head_dim=8),
            image_token_index=95,
        ),
        dict(model_class="Mistral3ForConditionalGeneration"),
    ),
    "mistral4": ("Mistral4Config", MISTRAL4, dict(model_class="Mistral4ForCausalLM")),
    "llama4_text": ("Llama4TextConfig", LLAMA4),
    "llama4": (
        "Llama4Config",
        dict(
            text_config=LLAMA4,
            vision_config=dict(VISION, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16),
            image_token_index=95,
        ),
        dict(model_class="Llama4ForConditionalGeneration"),
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        DEEPSEEK_V32 := dict(
            MISTRAL4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            index_topk=5,  # of up to 16 keys
            index_n_heads=8,  # enough heads that no two keys tie at an index score of 0 (every head's ReLU at 0)
            index_head_dim=16,
        ),
        dict(random_buffers=("e_score_correction_bias",)),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            BASE,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
        dict(random_buffers=("e_score_correction_bias",)),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(
            BASE,
            intermediate_size=32,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            rotary_dim=8,  # the published key for RoPE on half of each head
        ),
        dict(random_buffers=("e_score_correction_bias",)),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, folder, transformers' logits, ids); a config's third entry holds `save_reference`'s options."""
    config_class, config, *options = CONFIGS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    torch_model = save_reference(folder, config_class, **(options[0] if options else {}), **config)
    ids = random_ids(VOCAB)
    return request.param, folder, reference_logits(torch_model, ids), ids


def test_logits_match_transformers(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert max(cache_errors(model, ids, reference)) <= 1e-4


@pytest.mark.parametrize("checkpoint", ["olmo3"], indirect=True)
def test_olmo3_windows_and_norms_matter(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert [layer.attn.window for layer in model.layers] == [4, None, 4, 4]
    model.layers[0].attn.window = None
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-2


@pytest.mark.parametrize("checkpoint", ["ministral3"], indirect=True)
def test_ministral3_query_temperature_matters(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    for layer in model.layers:
        layer.attn.query_temperature = None
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3


def test_image_text_config_without_its_text_config_is_refused_in_one_line():
    with pytest.raises(CheckpointError, match="mistral3 config needs its text_config"):
        plugin_config({"model_type": "mistral3", "vision_config": {}})


@pytest.mark.parametrize("checkpoint", ["glm4_moe"], indirect=True)
def test_glm4_moe_routes_by_corrected_sigmoid_scores_within_groups(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    moe = model.layers[1].ffn
    assert (moe.router.scoring, moe.router.groups, moe.router.scale) == ("sigmoid", 2, 2.5)
    assert model.layers[0].attn.rope.dims == 8 and not model.layers[0].attn.rope.traditional
    for layer in model.layers[1:]:
        layer.ffn.router.score_bias = mx.zeros_like(layer.ffn.router.score_bias)
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3


@pytest.mark.parametrize("checkpoint", ["minimax_m2"], indirect=True)
def test_minimax_m2_rotates_rotary_dim_and_routes_by_corrected_scores(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert model.layers[0].attn.rope.dims == 8 and model.layers[0].attn.q_norm.weight.shape == (64,)
    for layer in model.layers:
        layer.ffn.router.score_bias = mx.zeros_like(layer.ffn.router.score_bias)
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3


@pytest.mark.parametrize("checkpoint", ["mistral4"], indirect=True)
def test_mistral4_latent_attention_temperature_and_grouped_routing(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    router = model.layers[1].ffn.router
    assert (router.scoring, router.groups, router.groups_kept, router.group_top) == ("softmax", 2, 1, 2)
    assert model.layers[0].attn.query_temperature is not None
    for layer in model.layers:
        layer.attn.query_temperature = None
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3


@pytest.mark.parametrize("checkpoint", ["llama4_text"], indirect=True)
def test_llama4_chunks_nope_layers_and_input_weighted_experts(checkpoint):
    """Chunks of 4 in the rotated layers (their caches never hold more than 3 tokens), the whole text and the query
    temperature in the fourth; each part changes the logits."""
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert [layer.attn.chunk for layer in model.layers] == [4, 4, 4, None]
    assert [layer.attn.rope is None for layer in model.layers] == [False, False, False, True]
    assert [layer.attn.query_temperature is not None for layer in model.layers] == [False, False, False, True]
    cache = model.make_cache()
    held = []
    for t in range(16):
        mx.eval(model(mx.array(ids[:, t : t + 1]), cache))
        held.append(cache[0].held)
    assert held == [min(t + 1, 3) for t in range(16)]
    assert isinstance(cache[0], ChunkedKVCache) and type(cache[3]) is KVCache
    for change in ("chunk", "query_temperature", "weighted_inputs"):
        model = minimlx.load_model(folder, dtype="float32")
        for layer in model.layers:
            if change != "weighted_inputs":
                setattr(layer.attn, change, None)
            elif isinstance(layer.ffn, MoE):
                layer.ffn.weighted_inputs = False
        assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3, change


@pytest.mark.parametrize("checkpoint", ["deepseek_v32"], indirect=True)
def test_deepseek_v32_attends_to_the_indexers_top_k_keys(checkpoint):
    """Each query past the fifth sees 5 of its keys; seeing them all changes the logits. The indexer's keys are cached
    beside the latents, one row of index_head_dim per token."""
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    model(mx.array(ids[:, :9]), cache)
    assert isinstance(cache[0], IndexedLatentCache) and cache[0].state[1].shape[-1] == 16
    for layer in model.layers:
        layer.attn.indexer.top_k = 16
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(index_topk=129), r"index_topk \(129\) is above the context"),
        (dict(num_key_value_heads=2), "sparse attention needs num_key_value_heads"),
    ],
)
def test_deepseek_v32_bad_configs_are_refused_in_one_line(change, message):
    with pytest.raises(CheckpointError, match=message):
        plugin_config(dict(DEEPSEEK_V32, model_type="deepseek_v32", **change))


TEXT_ONLY = ["deepseek_v32", "glm4_moe", "llama4_text", "minimax_m2", "ministral3", "mistral4", "olmo3"]


@pytest.mark.parametrize("checkpoint", TEXT_ONLY, indirect=True)
def test_ledger_counts_from_the_config_what_transformers_holds(checkpoint):
    """The anatomy ledger of the config alone: transformers' parameters, plus the routers' correction biases (kept
    there as buffers)."""
    transformers = require("transformers")
    name, folder, *_ = checkpoint
    _, _, *options = CONFIGS[name]
    model_class = getattr(transformers, options[0]["model_class"]) if options and "model_class" in options[0] else None
    model = (model_class or transformers.AutoModelForCausalLM).from_pretrained(folder)
    biases = [b for key, b in model.named_buffers() if key.endswith("e_score_correction_bias")]
    assert ledger(folder).total == sum(p.numel() for p in [*model.parameters(), *biases])


@pytest.mark.parametrize("checkpoint", ["llama4_text", "deepseek_v32"], indirect=True)
def test_new_caches_serve_speculation_and_prompt_cache_files(checkpoint):
    """Chunked and indexed caches under the engine's other uses (`check_speculation_and_prompt_cache_files`)."""
    _, folder, _, ids = checkpoint
    check_speculation_and_prompt_cache_files(minimlx.load_model(folder, dtype="float32"), ids)
