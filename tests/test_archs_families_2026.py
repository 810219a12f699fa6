"""The 2025-26 families: olmo3, ministral3 (and mistral3's text model), glm4_moe, minimax_m2, ...

Each tiny random transformers model (every layer kind among its first layers, windows shorter than the 16 test
tokens) is saved, loaded by minimlx and compared on float32 logits: the whole sequence at once, token by token
through the cache from the start, and a 9-token prompt then single steps.
"""

import mlx.core as mx
import numpy as np
import pytest
from families_2026 import CONFIGS, DEEPSEEK_V32, VOCAB, family_config, save_family
from models import check_speculation_and_prompt_cache_files
from reference import cache_errors, random_ids, reference_logits, relative_error, require

import minimlx
from minimlx.anatomy.ledger import ledger
from minimlx.archs import plugin_config
from minimlx.core import ChunkedKVCache, IndexedLatentCache, KVCache, MoE
from minimlx.errors import CheckpointError


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, folder, transformers' logits, ids)."""
    folder = tmp_path_factory.mktemp(request.param)
    torch_model = save_family(folder, request.param)
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


def test_deepseek_v32_breaks_index_ties_as_transformers_does(tmp_path):
    """A one-head indexer scores many keys 0 (its ReLU), so keys tie at the top-k-th score: minimlx keeps those
    transformers keeps, over the whole sequence and over a prompt then single steps through the cache (which differ
    from each other: torch's choice among ties depends on the row, and a cached step's row has no masked keys)."""
    torch = require("torch")
    import minimlx.core.sparse_attention as sparse

    torch_model = save_family(tmp_path, "deepseek_v32", family_config("deepseek_v32", index_n_heads=1))
    ids = random_ids(VOCAB)
    with torch.no_grad():
        prompt = torch_model(torch.tensor(ids[:, :9]), use_cache=True)
        steps, cache = [prompt.logits], prompt.past_key_values
        for t in range(9, ids.shape[1]):
            step = torch_model(torch.tensor(ids[:, t : t + 1]), past_key_values=cache, use_cache=True)
            steps.append(step.logits)
    stepped = torch.cat(steps, 1).numpy()
    whole = reference_logits(torch_model, ids)
    model = minimlx.load_model(tmp_path, dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), whole) <= 1e-4
    assert cache_errors(model, ids, stepped)[2] <= 1e-4  # the prompt, then single steps
    assert relative_error(stepped, whole) > 1e-2
    with pytest.MonkeyPatch.context() as patch:  # the earliest of the tied keys instead: other logits
        patch.setattr(sparse, "kept", lambda values, k: sorted(np.argsort(-np.array(values), kind="stable")[:k]))
        assert relative_error(np.array(model(mx.array(ids))), whole) > 1e-2


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
