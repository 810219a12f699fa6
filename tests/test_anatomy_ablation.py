"""Ablations through the one loop, each against a reference computed another way: a head switched off equals its
slice of the output projection zeroed, a block switched off equals the model without it, an expert switched off
is never chosen and the FFN output is rebuilt from the routing the trace records, a patch lands where it says."""

import mlx.core as mx
import pytest
from traced_models import IDS, random_model

import minimlx
from minimlx.anatomy.ablation import Ablation, Patch
from minimlx.anatomy.lens import unembed
from minimlx.anatomy.trace import patch_from
from minimlx.errors import InvalidSettingError


@pytest.fixture(scope="module")
def llama():
    return random_model("llama")


@pytest.fixture(scope="module")
def moe():
    return random_model("qwen3_moe")


def logits(model, ablate=None):
    return minimlx.trace(model, IDS, ["logits"], ablate=ablate)["logits"]


def test_a_head_off_is_its_slice_of_the_output_projection_zeroed(llama):
    before = logits(llama)
    ablated = logits(llama, Ablation(heads=((1, 2),)))
    attn = llama.layers[1].attn
    weight = attn.o_proj.weight
    width = weight.shape[1] // attn.heads
    zeroed = mx.concatenate(
        [weight[:, : 2 * width], mx.zeros_like(weight[:, 2 * width : 3 * width]), weight[:, 3 * width :]], axis=1
    )
    attn.o_proj.weight = zeroed
    try:
        reference = logits(llama)
    finally:
        attn.o_proj.weight = weight
    assert mx.allclose(ablated, reference, atol=1e-5)
    assert not mx.allclose(ablated, before, atol=1e-3)
    assert mx.array_equal(logits(llama), before)  # the model is put back


def test_a_block_off_is_the_model_without_it(llama):
    ablated = minimlx.trace(llama, IDS, ablate=Ablation(blocks=(1,)))
    assert mx.array_equal(ablated["layers.1.resid_post"], ablated["layers.1.resid_pre"])
    layers = llama.layers
    llama.layers = [layers[0], layers[2]]
    try:
        reference = logits(llama)
    finally:
        llama.layers = layers
    assert mx.allclose(ablated["logits"], reference, atol=1e-5)


def test_an_expert_off_is_never_chosen_and_the_rest_route_as_recorded(moe):
    values = minimlx.trace(moe, IDS, ablate=Ablation(experts=((1, 3), (1, 5))))
    before = minimlx.trace(moe, IDS)
    indices, weights = values["layers.1.expert_indices"], values["layers.1.expert_weights"]
    assert mx.any(before["layers.1.expert_indices"] == 3).item()  # expert 3 had tokens before
    assert not mx.any((indices == 3) | (indices == 5)).item()
    ffn = moe.layers[1].ffn
    x = moe.layers[1].ffn_norm(values["layers.1.resid_mid"])
    rebuilt = (ffn.experts(x, indices) * weights[..., None]).sum(axis=-2)
    assert mx.allclose(rebuilt, values["layers.1.mlp_out"], atol=1e-4)
    assert mx.allclose(weights.sum(-1), mx.ones(weights.shape[:-1]), atol=1e-5)  # renormalised over the kept ones


def test_a_patch_replaces_the_stream_where_it_says(llama):
    other = [9, 9, 14, 2]
    patch = patch_from(llama, other, layer=2)
    values = minimlx.trace(llama, IDS, ablate=Ablation(patches=(patch,)))
    source = minimlx.trace(llama, other, ["layers.2.resid_post"])["layers.2.resid_post"][0, -1]
    assert mx.array_equal(values["layers.2.resid_post"][0, -1], source)
    assert mx.allclose(values["logits"][0, -1], unembed(llama, source), atol=1e-5)
    same = Patch(1, 4, minimlx.trace(llama, IDS, ["layers.1.resid_post"])["layers.1.resid_post"][0, 4])
    assert mx.allclose(logits(llama, Ablation(patches=(same,))), logits(llama), atol=1e-6)


def test_the_lens_takes_the_same_ablation(llama):
    class Words:
        def encode(self, text):
            return IDS[0].tolist()

        def decode(self, ids):
            return f"w{ids[0]}"

    ablate = Ablation(heads=((0, 1),), blocks=(2,))
    lens = minimlx.anatomy.lens.logit_lens(llama, Words(), "", top_k=3, ablate=ablate)
    probs = mx.softmax(logits(llama, ablate)[0, -1], axis=-1)
    assert lens.top_ids[-1][-1][0] == mx.argmax(probs).item()
    assert lens.top_probs[-1][-1][0] == pytest.approx(probs.max().item(), abs=1e-6)


@pytest.mark.parametrize(
    "ablate, message",
    [
        (Ablation(heads=((0, 4),)), "head must be between 0 and 3"),
        (Ablation(blocks=(3,)), "layer must be between 0 and 2"),
        (Ablation(experts=((0, 1),)), "layer 0 has no experts"),
        (Ablation(experts=tuple((1, e) for e in range(7))), "keep at least that many on"),
    ],
)
def test_bad_ablations_say_what_is_wrong(moe, ablate, message):
    with pytest.raises(InvalidSettingError, match=message):
        minimlx.trace(moe, IDS, ablate=ablate)
