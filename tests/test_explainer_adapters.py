"""The explainer on a model loaded with an adapter: the walk is the adapted model's, and its `adapter` figures (what
each block adds before and after, how far the stream moved, the base's next tokens) equal what the base loaded on its
own and the adapted model compute (within 1e-5), in the walk the Python API returns, the one the served API answers
(under an ablation too) and the one a file written by `minimlx explain --adapter` carries."""

import json
import re

import mlx.core as mx
import pytest
from starlette.testclient import TestClient

import minimlx
from minimlx.anatomy.ablation import Ablation
from minimlx.explainer.server import ExplainServer

PROMPT = "w3 w9 w27 w81 w50 w12"
NAMES = [f"layers.{i}.{what}" for i in range(2) for what in ("attn_out", "mlp_out", "resid_post")] + ["logits"]


@pytest.fixture(scope="module")
def models(adapted_llama):
    """(base, adapted model, tokenizer): the base loaded on its own, beside the model loaded with the adapter."""
    folder, adapter = adapted_llama
    adapted, tokenizer = minimlx.load(folder, "float32", adapter=adapter)
    return minimlx.load_model(folder, "float32"), adapted, tokenizer


def norms(x: mx.array) -> mx.array:
    return mx.linalg.norm(x[0], axis=-1)


def assert_shows(figures: dict, base, adapted, ids, ablate=None):
    """`figures` (the walk's `adapter`) within 1e-5 of the norms and probabilities traced from each model directly."""
    before, after = (minimlx.trace(model, ids, NAMES, ablate=ablate) for model in (base, adapted))
    for i, block in enumerate(figures["blocks"]):
        attn, mlp, stream = (f"layers.{i}.{what}" for what in ("attn_out", "mlp_out", "resid_post"))
        expected = {
            "attn_before": norms(before[attn]),
            "attn_after": norms(after[attn]),
            "mlp_before": norms(before[mlp]),
            "mlp_after": norms(after[mlp]),
            "shift": norms(after[stream] - before[stream]) / norms(before[stream]),
        }
        for key, values in expected.items():
            assert mx.abs(mx.array(block[key]) - values).max().item() < 1e-5, (i, key)
    probs = mx.softmax(before["logits"][0, -1], axis=-1)
    shown = figures["next_base"]
    assert shown[0]["id"] == mx.argmax(probs).item()
    assert all(abs(n["prob"] - probs[n["id"]].item()) < 1e-5 for n in shown)


def test_the_walk_shows_the_base_against_the_adapted_model(models):
    base, adapted, tokenizer = models
    walk = minimlx.explain(adapted, tokenizer, PROMPT).walk
    ids = walk["ids"]
    assert_shows(walk["adapter"], base, adapted, ids)
    first, last = walk["adapter"]["blocks"]  # the adapter changes the last block only
    assert first["shift"] == [0.0] * len(ids) and first["attn_before"] == first["attn_after"]
    assert min(last["shift"]) > 0.01
    probs = mx.softmax(adapted(mx.array([ids]))[0, -1], axis=-1)  # the rest of the walk is the adapted model's
    assert all(abs(n["prob"] - probs[n["id"]].item()) < 1e-5 for n in walk["next"])
    assert minimlx.explain(base, tokenizer, PROMPT).walk["adapter"] is None


def test_the_served_api_answers_the_same_figures_under_an_ablation_too(models):
    base, adapted, tokenizer = models
    client = TestClient(ExplainServer(adapted, tokenizer, "tiny llama + adapter").app)
    assert client.get("/api/info").json()["adapted"] is True
    walk = client.post("/api/explain", json={"prompt": PROMPT}).json()
    assert_shows(walk["adapter"], base, adapted, walk["ids"])
    off = client.post("/api/explain", json={"prompt": PROMPT, "ablate": {"blocks": [1]}}).json()
    assert_shows(off["adapter"], base, adapted, off["ids"], Ablation(blocks=(1,)))
    # with the only adapted block switched off, the two models' streams agree everywhere
    assert [max(b["shift"]) for b in off["adapter"]["blocks"]] == [0.0, 0.0]
    assert off["adapter"]["next_base"] == off["next"]


def test_the_cli_writes_the_adapted_walk_with_the_base_beside_it(adapted_llama, models, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main

    base, adapted, tokenizer = models
    folder, adapter = adapted_llama
    out = tmp_path / "walk.html"
    args = ["explain", "--model", str(folder), "--adapter", str(adapter), "--prompt", PROMPT, "--html", str(out)]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    text = out.read_text()
    payload = re.search(r"minimlxExplain\(document\.getElementById\(\"[^\"]+\"\), (.*)\);</script>", text)
    data = json.loads(payload.group(1).replace("<\\/", "</"))
    assert_shows(data["data"]["walk"]["adapter"], base, adapted, data["data"]["walk"]["ids"])
    assert f"+ adapter {adapter}" in text and "drawAdapter" in text
