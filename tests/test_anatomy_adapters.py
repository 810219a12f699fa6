"""Anatomy of an adapted model: the ledger counts the adapters' parameters apart, `detached` puts the base back in the
adapted model's place, and `adapter_effect` traces the base and the adapted model on one prompt (a block before the
adapted one adds exactly what the base's adds)."""

import json

import mlx.core as mx
import pytest

import minimlx
from minimlx.anatomy.adapted import adapter_effect
from minimlx.errors import InvalidSettingError
from minimlx.tune import adapters, detached

IDS = [3, 9, 27, 81, 50, 12]


def test_the_ledger_counts_adapter_parameters_apart(adapted_llama):
    folder, adapter = adapted_llama
    base = minimlx.ledger(minimlx.load_model(folder, "float32"))
    adapted = minimlx.ledger(model := minimlx.load(folder, "float32", adapter=adapter)[0])
    expected = sum(form.lora_a.size + form.lora_b.size for form in adapters(model).values())
    assert adapted.components["adapters"] == expected == 4 * (64 + 64) + 4 * (64 + 32) + 4 * (128 + 64)
    assert adapted.total == base.total + expected and adapted.layers[1]["adapters"] == expected
    assert {k: v for k, v in adapted.components.items() if k != "adapters"} == base.components


def test_detached_runs_the_base_in_the_adapted_models_place(adapted_llama):
    folder, adapter = adapted_llama
    base, adapted = minimlx.load_model(folder, "float32"), minimlx.load(folder, "float32", adapter=adapter)[0]
    ids = mx.array([IDS])
    logits = adapted(ids)
    assert not mx.allclose(logits, base(ids), atol=1e-3)
    with detached(adapted):
        assert adapters(adapted) == {} and mx.array_equal(adapted(ids), base(ids))
    assert len(adapters(adapted)) == 3 and mx.array_equal(adapted(ids), logits)
    with pytest.raises(InvalidSettingError, match="no adapter to detach"), detached(base):
        pass


def test_adapter_effect_shows_what_each_block_adds_before_and_after(adapted_llama):
    from click.testing import CliRunner

    from minimlx.cli import main

    folder, adapter = adapted_llama
    base, adapted = minimlx.load_model(folder, "float32"), minimlx.load(folder, "float32", adapter=adapter)[0]
    effect = adapter_effect(adapted, IDS)
    first, last = effect.blocks
    assert (first.attn_before, first.mlp_before, first.shift) == (first.attn_after, first.mlp_after, 0.0)
    assert last.attn_after != pytest.approx(last.attn_before) and last.shift > 0.01
    norms = minimlx.trace(base, IDS, ["layers.1.attn_out"])["layers.1.attn_out"][0]
    assert last.attn_before == pytest.approx(mx.linalg.norm(norms, axis=-1).mean().item(), rel=1e-6)
    logits = [model(mx.array([IDS]))[0, -1] for model in (base, adapted)]
    assert [effect.next_before, effect.next_after] == [int(mx.argmax(x).item()) for x in logits]

    text = "w3 w9 w27 w81 w50 w12"
    shown = CliRunner().invoke(main, ["adapter-effect", str(folder), text, "--adapter", str(adapter)])
    assert shown.exit_code == 0, shown.output
    effect = adapter_effect(adapted, minimlx.load(folder)[1].encode(text))
    assert f"{effect.blocks[1].shift:.1%}" in shown.output and "next token:" in shown.output


def test_lens_attention_and_compare_look_inside_the_adapted_model(adapted_llama):
    from click.testing import CliRunner

    from minimlx.anatomy.attention import attention_pattern
    from minimlx.anatomy.lens import logit_lens
    from minimlx.anatomy.similarity import compare_word
    from minimlx.cli import main
    from minimlx.cli.attention import table

    folder, adapter = adapted_llama
    adapted, tokenizer = minimlx.load(folder, "float32", adapter=adapter)
    base = minimlx.load_model(folder, "float32")
    text = "w3 w9 w27 w81 w50 w12"
    shown = CliRunner().invoke(main, ["lens", str(folder), text, "--json", "--adapter", str(adapter)])
    assert shown.exit_code == 0, shown.output
    probs = mx.array(json.loads(shown.output)["top_probs"])
    expected, unadapted = (mx.array(logit_lens(m, tokenizer, text).top_probs) for m in (adapted, base))
    assert mx.abs(probs - expected).max().item() < 1e-5 and mx.abs(probs - unadapted).max().item() > 1e-3
    shown = CliRunner().invoke(main, ["attention", str(folder), text, "--layer", "1", "--adapter", str(adapter)])
    assert shown.exit_code == 0, shown.output
    patterns = [table(attention_pattern(m, tokenizer, text, 1)) for m in (adapted, base)]
    assert shown.output.rstrip("\n") == patterns[0] != patterns[1]
    other = "w5 w9 w27 w81 w7 w12"
    args = ["compare", str(folder), text, other, "--word", "w27", "--json", "--adapter", str(adapter)]
    shown = CliRunner().invoke(main, args)
    assert shown.exit_code == 0, shown.output
    similarity = [compare_word(m, tokenizer, text, other, "w27").similarity for m in (adapted, base)]
    assert json.loads(shown.output)["similarity"] == pytest.approx(similarity[0], abs=1e-5)
    assert similarity[0][-1] != pytest.approx(similarity[1][-1], abs=1e-4)
