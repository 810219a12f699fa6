"""Anatomy of an adapted model: the ledger counts the adapters' parameters apart, and `adapter_effect` traces the base
and the adapted model on one prompt (a block before the adapted one adds exactly what the base's adds)."""

import mlx.core as mx
import pytest

import minimlx
from minimlx.anatomy.adapted import adapter_effect
from minimlx.tune import AdapterSettings, adapters, attach, save_adapter

IDS = [3, 9, 27, 81, 50, 12]


def adapted_copy(folder):
    """The model in `folder` with a rank-4 LoRA on the last block's q, v and down projections, B random."""
    model = minimlx.load_model(folder, "float32")
    attach(model, AdapterSettings(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), layers=1))
    mx.random.seed(7)
    for form in adapters(model).values():
        form.lora_b = mx.random.normal(form.lora_b.shape) * 0.5
    return model.eval()


def test_the_ledger_counts_adapter_parameters_apart(hf_folder):
    folder = hf_folder("llama")
    base = minimlx.ledger(minimlx.load_model(folder, "float32"))
    adapted = minimlx.ledger(model := adapted_copy(folder))
    expected = sum(form.lora_a.size + form.lora_b.size for form in adapters(model).values())
    assert adapted.components["adapters"] == expected == 4 * (64 + 64) + 4 * (64 + 32) + 4 * (128 + 64)
    assert adapted.total == base.total + expected and adapted.layers[1]["adapters"] == expected
    assert {k: v for k, v in adapted.components.items() if k != "adapters"} == base.components


def test_adapter_effect_shows_what_each_block_adds_before_and_after(hf_folder, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main

    folder = hf_folder("llama")
    base, adapted = minimlx.load_model(folder, "float32"), adapted_copy(folder)
    effect = adapter_effect(base, adapted, IDS)
    first, last = effect.blocks
    assert (first.attn_before, first.mlp_before, first.shift) == (first.attn_after, first.mlp_after, 0.0)
    assert last.attn_after != pytest.approx(last.attn_before) and last.shift > 0.01
    norms = minimlx.trace(base, IDS, ["layers.1.attn_out"])["layers.1.attn_out"][0]
    assert last.attn_before == pytest.approx(mx.linalg.norm(norms, axis=-1).mean().item(), rel=1e-6)
    logits = [model(mx.array([IDS]))[0, -1] for model in (base, adapted)]
    assert [effect.next_before, effect.next_after] == [int(mx.argmax(x).item()) for x in logits]

    save_adapter(adapted, tmp_path / "adapter")
    text = "w3 w9 w27 w81 w50 w12"
    shown = CliRunner().invoke(main, ["adapter-effect", str(folder), text, "--adapter", str(tmp_path / "adapter")])
    assert shown.exit_code == 0, shown.output
    effect = adapter_effect(base, adapted, minimlx.load(folder)[1].encode(text))
    assert f"{effect.blocks[1].shift:.1%}" in shown.output and "next token:" in shown.output
