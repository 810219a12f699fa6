"""minimlx.tune.stages: a training step a stage at a time gives the whole step's loss and gradients (LoRA, full
fine-tuning with a trained head, tied or not, soft-capped scores), and validation's loss without gradients."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from tuning import CONFIG

from minimlx.archs import build_model
from minimlx.tune import AdapterSettings, attach, masked_loss
from minimlx.tune.stages import stagewise_loss, stagewise_loss_and_grad

SOFT_CAPPED = dict(
    CONFIG, model_type="gemma2", head_dim=8, query_pre_attn_scalar=8, sliding_window=4, final_logit_softcapping=3.0,
    attn_logit_softcapping=5.0, tie_word_embeddings=True,
)  # fmt: skip


def trained(config: dict, targets) -> nn.Module:
    mx.random.seed(0)
    model = build_model(config)
    if targets == "full":
        model.unfreeze()
    else:
        attach(model, AdapterSettings(rank=4, targets=targets))
        model.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), model.trainable_parameters()))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize(
    "config, targets",
    [
        (CONFIG, "all-linear"),
        (dict(CONFIG, tie_word_embeddings=True), "all-linear"),
        (CONFIG, "full"),
        (dict(CONFIG, tie_word_embeddings=True), "full"),
        (SOFT_CAPPED, "all-linear"),
    ],
    ids=["lora", "lora-tied", "full-untied", "full-tied", "soft-capped"],
)
def test_a_step_a_stage_at_a_time_equals_the_whole_step(config, targets):
    model = trained(config, targets)
    ids = mx.random.randint(0, config["vocab_size"], (2, 24), key=mx.random.key(1))
    mask = mx.random.uniform(shape=ids.shape, key=mx.random.key(2)) > 0.3
    (whole, counted), want = nn.value_and_grad(model, masked_loss)(model, ids, mask)
    (loss, staged_count), got = stagewise_loss_and_grad(model, ids, mask)
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6) and staged_count.item() == counted.item()
    want, got = dict(tree_flatten(want)), dict(tree_flatten(got))
    assert got.keys() == want.keys() and len(got) > 0
    for name, grad in want.items():
        np.testing.assert_allclose(np.array(got[name]), np.array(grad), rtol=1e-4, atol=1e-6, err_msg=name)
    validation, validation_count = stagewise_loss(model, ids, mask)
    assert validation.item() == pytest.approx(whole.item(), rel=1e-6) and validation_count.item() == counted.item()
