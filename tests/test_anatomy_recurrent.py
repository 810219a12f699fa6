"""Anatomy, the explainer and the distributed split on a model with recurrent layers (tests/hybrid_model.py: Gated
DeltaNet in layers 0 and 2, attention in 1 and 3): a recurrent layer declares that it does not attend, so the trace
records attention for the attention layers only (and the recurrent ones' state norms), an attention map or a head
of a recurrent layer is refused in one line, the explainer's walk shows no map for it, the placement plan counts no
per-token cache for it, and a pipeline's ranks carry its state: their halves chained give the whole model's logits,
a prompt then steps."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference import relative_error

import minimlx
from minimlx.anatomy.ablation import Ablation
from minimlx.anatomy.attention import attention_pattern
from minimlx.anatomy.trace import trace
from minimlx.core import RecurrentCache
from minimlx.distributed.pipeline import PipelineSplit
from minimlx.distributed.placement import plan
from minimlx.errors import InvalidSettingError
from minimlx.explainer.walk import attention_layer, walk

pytestmark = pytest.mark.slow  # transformers' model and SmolLM2's tokenizer, built once a session
TEXT = "the cat sat on the mat and looked at the door"


def test_trace_records_attention_of_attention_layers_only(hybrid):
    _, torch_model, model, tokenizer = hybrid
    ids = tokenizer.encode(TEXT)
    values = trace(model, ids, attention=True)
    assert [i for i in range(4) if f"layers.{i}.attn_weights" in values] == [1, 3]
    rows = np.array(values["layers.3.attn_weights"][0]).sum(axis=-1)
    assert np.allclose(rows, 1, atol=1e-5)
    with pytest.raises(InvalidSettingError, match="layer 0 is a recurrent layer"):
        trace(model, ids, ["layers.0.attn_weights"])
    assert attention_pattern(model, tokenizer, TEXT).layer == 3
    with pytest.raises(InvalidSettingError, match=r"recurrent layer.*attention layers \[1, 3\]"):
        attention_pattern(model, tokenizer, TEXT, layer=2)
    with pytest.raises(InvalidSettingError, match="no attention heads to switch off"):
        trace(model, ids, ablate=Ablation(heads=((0, 1),)))


def test_switching_a_recurrent_block_off_leaves_its_stream_as_it_came(hybrid):
    _, _, model, tokenizer = hybrid
    ids = tokenizer.encode(TEXT)
    values = trace(model, ids, ["layers.0.resid_pre", "layers.0.resid_post"], ablate=Ablation(blocks=(0,)))
    assert np.array_equal(np.array(values["layers.0.resid_pre"]), np.array(values["layers.0.resid_post"]))


def test_trace_records_a_recurrent_state_norm(hybrid):
    """`layers.<i>.state_norm`: the norm of the state the layer's pass leaves, as its cache then holds it."""
    _, _, model, tokenizer = hybrid
    ids = tokenizer.encode(TEXT)
    values = trace(model, ids)
    assert [i for i in range(4) if f"layers.{i}.state_norm" in values] == [0, 2]
    cache = model.make_cache()
    model(mx.array([ids]), cache)
    for i in (0, 2):
        expected = np.linalg.norm(np.array(cache[i].recurrent))
        assert abs(values[f"layers.{i}.state_norm"].item() - expected) <= 1e-4 * expected


def test_explainer_walk_shows_no_map_for_a_recurrent_layer(hybrid):
    _, _, model, tokenizer = hybrid
    ids = tokenizer.encode(TEXT)
    page = walk(model, tokenizer, ids)
    assert page["heads"] == [0, 4, 0, 4] and [len(a) for a in page["attention"]] == [0, 4, 0, 4]
    assert attention_layer(model, ids, 0) == [] and len(attention_layer(model, ids, 1)) == 4
    assert all(len(block["attn_norm"]) == len(ids) for block in page["blocks"])  # what each layer adds, per token
    assert [block["state_norm"] is None for block in page["blocks"]] == [False, True, False, True]


class Rank:
    """A stand-in for one rank's `mx.distributed.Group`: its rank among `size`."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = (lambda: rank), (lambda: size)


def test_pipeline_ranks_carry_recurrent_caches(hybrid):
    folder, _, model, _ = hybrid
    halves = []
    for rank in range(2):
        part = minimlx.load_model(folder, dtype="float32")
        kept = PipelineSplit(Rank(rank, 2), room=1 << 40).cut(part, dict(tree_flatten(part.parameters())))
        part.load_weights(list(kept.items()), strict=False)  # the other rank's ends are not this one's
        halves.append(part)
    assert [type(c).__name__ for h in halves for c in h.make_cache()] == [
        "RecurrentCache",
        "KVCache",
        "RecurrentCache",
        "KVCache",
    ]
    assert [p.kv_bytes_per_1k for p in plan(model, 2)] == [2 * 2 * 16 * 4 * 1024] * 2  # the attention layer's only
    ids = np.random.default_rng(0).integers(0, 49152, (1, 40))
    caches = [h.make_cache() for h in halves]

    def chained(chunk):
        x = halves[0].embed(mx.array(chunk))
        for half, cache in zip(halves, caches):
            for layer, c in zip(half.layers, cache):
                x = layer(x, c, None, None)
        return halves[1].embed.as_linear(halves[1].norm(x))

    steps = [chained(ids[:, :30])] + [chained(ids[:, t : t + 1]) for t in range(30, 40)]
    assert all(isinstance(c, RecurrentCache) and c.offset == 40 for c in (caches[0][0], caches[1][0]))
    whole = model(mx.array(ids))
    assert relative_error(np.array(mx.concatenate(steps, axis=1)), np.array(whole)) <= 1e-5
