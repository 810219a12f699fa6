"""`minimlx explain` in headless Chromium: the page's figures are the Python API's (lens, attention, next-token
probabilities, ablations, routing, an adapted model against its base), it asks nothing of any address but its own,
and its standalone forms (--html, Jupyter) show the same walk with the network off."""

import subprocess
import sys

import mlx.core as mx
import pytest
from explain_browser import Explained, Page, chromium

import minimlx
from minimlx.anatomy.ablation import Ablation
from minimlx.explainer.walk import MAX_TOKENS

pytestmark = pytest.mark.slow  # SmolLM2 in headless Chromium

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def browser():
    playwright, browser = chromium()
    yield browser
    browser.close()
    playwright.stop()


@pytest.fixture(scope="module")
def served(smollm2):
    server = Explained(*smollm2, "smollm2-135m")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(browser, served):
    page = Page(browser, served.url + "/")
    page.explain(PROMPT)
    return page


def final_probs(model, ids, ablate=None) -> mx.array:
    return mx.softmax(minimlx.trace(model, ids, ["logits"], ablate=ablate)["logits"][0, -1], axis=-1)


def assert_next_matches(page_probs: dict[int, float], probs: mx.array):
    assert page_probs and all(abs(p - probs[i].item()) < 1e-4 for i, p in page_probs.items())
    assert max(page_probs, key=page_probs.get) == mx.argmax(probs).item()


def test_the_page_shows_the_walk_the_python_api_computes(page, served, smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPT)
    tokens = page.page.locator(".mx-tokens .mx-token").evaluate_all("t => t.map(e => Number(e.dataset.id))")
    assert tokens == ids
    lens = minimlx.anatomy.lens.logit_lens(model, tokenizer, PROMPT)
    shown = page.lens_tokens()
    assert len(shown) == (len(model.layers) + 1) * len(ids)
    assert all(shown[r, p] == lens.top_tokens[r][p][0] for r, p in shown)
    assert lens.top_tokens[-1][-1][0] == " Paris"  # the seed's example
    page.page.select_option("select[name=layer]", "5")
    page.page.click("canvas[data-layer='5'][data-head='3']")
    enlarged = page.page.locator("canvas.mx-enlarged[data-layer='5'][data-head='3']")
    weights = mx.array(__import__("json").loads(enlarged.get_attribute("data-weights")))
    reference = minimlx.trace(model, ids, ["layers.5.attn_weights"])["layers.5.attn_weights"][0, 3]
    assert mx.abs(weights - reference).max().item() < 1e-3
    assert_next_matches(page.next_probs(), final_probs(model, ids))
    assert page.errors == []
    assert page.requests and all(url.startswith(served.url + "/") for url in page.requests)


def test_ablating_a_head_and_a_block_changes_the_distribution_as_the_api_does(page, smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode(PROMPT)
    page.page.select_option("select[name=layer]", "5")
    page.page.click("canvas[data-layer='5'][data-head='3']")
    page.after(lambda: page.page.click("button[name=ablate-head]"))
    assert_next_matches(page.next_probs(), final_probs(model, ids, Ablation(heads=((5, 3),))))
    page.after(lambda: page.page.click("button[name=ablate-block][data-layer='20']"))
    both = final_probs(model, ids, Ablation(heads=((5, 3),), blocks=(20,)))
    assert_next_matches(page.next_probs(), both)
    assert not mx.allclose(both, final_probs(model, ids), atol=1e-3)
    page.after(lambda: page.page.click("button[name=clear]"))
    assert_next_matches(page.next_probs(), final_probs(model, ids))


def test_stepping_appends_the_greedy_token(page, smollm2):
    model, _ = smollm2
    before = page.page.locator(".mx-tokens .mx-token").evaluate_all("t => t.map(e => Number(e.dataset.id))")
    top = max(page.next_probs().items(), key=lambda kv: kv[1])[0]
    page.after(lambda: page.page.click("button[name=step]"))
    after = page.page.locator(".mx-tokens .mx-token").evaluate_all("t => t.map(e => Number(e.dataset.id))")
    assert after == before + [top]
    assert_next_matches(page.next_probs(), final_probs(model, after))
    assert len(page.lens_tokens()) == (len(model.layers) + 1) * len(after)


def test_the_moe_view_shows_the_routers_choices_and_expert_ablation_matches(browser, hf_folder):
    model, tokenizer = minimlx.load(str(hf_folder("qwen3_moe")), dtype="float32")
    server = Explained(model, tokenizer, "tiny qwen3_moe")
    try:
        page = Page(browser, server.url + "/")
        prompt = "w5 w17 w3 w42 w8 w8 w60"
        page.explain(prompt)
        ids = tokenizer.encode(prompt)
        values = minimlx.trace(model, ids)
        routed = [i for i in range(len(model.layers)) if f"layers.{i}.expert_indices" in values]
        assert routed
        for layer in routed:
            shown = page.page.locator(f".mx-experts[data-layer='{layer}'] tr").evaluate_all(
                "rows => rows.map(r => [...r.querySelectorAll('td')].map(c => Number(c.dataset.expert)))"
            )
            assert shown == values[f"layers.{layer}.expert_indices"][0].tolist()
        layer, expert = routed[0], values[f"layers.{routed[0]}.expert_indices"][0, -1, 0].item()
        page.after(lambda: page.page.click(f"button[name=ablate-expert][data-layer='{layer}'][data-expert='{expert}']"))
        assert_next_matches(page.next_probs(), final_probs(model, ids, Ablation(experts=((layer, expert),))))
        load = page.page.locator(f".mx-experts[data-layer='{layer}'] + .mx-load .mx-load-row[data-expert='{expert}']")
        assert load.get_attribute("data-load") == "0"
        assert page.errors == []
    finally:
        server.stop()


def test_the_standalone_file_and_the_notebook_show_the_same_walk_offline(browser, smollm2, tmp_path):
    model, tokenizer = smollm2
    explanation = minimlx.explain(model, tokenizer, PROMPT, title="smollm2-135m")
    lens = minimlx.anatomy.lens.logit_lens(model, tokenizer, PROMPT)
    ids = tokenizer.encode(PROMPT)
    path = tmp_path / "walk.html"
    explanation.save(path)
    context = browser.new_context(offline=True)
    try:
        for load in (lambda p: p.page.goto(path.as_uri()), lambda p: p.page.set_content(explanation._repr_html_())):
            page = Page(context)
            load(page)
            page.page.wait_for_selector(".mx-explain[data-ready='1']")
            shown = page.lens_tokens()
            assert all(shown[r, p] == lens.top_tokens[r][p][0] for r, p in shown) and len(shown) == 31 * len(ids)
            assert_next_matches(page.next_probs(), final_probs(model, ids))
            assert page.page.locator("canvas.mx-enlarged").count() == 1
            assert page.errors == []
            assert all(url.startswith(("file://", "about:", "data:")) for url in page.requests)
    finally:
        context.close()


def test_the_api_bounds_prompts_and_answers_bad_input_with_4xx(served):
    status, walk = served.post("/api/explain", {"prompt": "word " * 2000})
    assert status == 200 and len(walk["tokens"]) == MAX_TOKENS and walk["attention"] is None
    assert f"the walk shows its last {MAX_TOKENS}" in walk["note"]
    status, one = served.post("/api/attention", {"ids": walk["ids"], "layer": 3})
    assert status == 200 and len(one["weights"]) == 9 and len(one["weights"][0]) == MAX_TOKENS
    for body, message in [
        (b"{not json", "JSON object"),
        ({"prompt": ""}, "prompt must be a non-empty string"),
        ({"prompt": "a", "ablate": {"heads": [[99, 0]]}}, "layer must be between 0 and 29"),
        ({"prompt": "a", "ablate": {"heads": [[1, 9]]}}, "head must be between 0 and 8"),
        ({"prompt": "a", "ablate": {"experts": [[1, 0]]}}, "no experts"),
        ({"ids": [1, 10**9]}, "outside the model's vocabulary"),
    ]:
        status, error = served.post("/api/explain", body)
        assert status == 400 and message in error["error"]["message"], (body, error)
    assert served.post("/api/next", {"prompt": "a", "top_p": 2})[0] == 400
    assert served.post("/api/nothing", {})[0] == 404


def test_the_cli_writes_the_file_and_refuses_bad_options(tmp_path):
    out = tmp_path / "walk.html"
    run = subprocess.run(
        [sys.executable, "-m", "minimlx", "explain", "--model", "smollm2-135m", "--prompt", PROMPT, "--html", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert '"tokens": ["The", " capital", " of", " France", " is"]' in out.read_text()
    run = subprocess.run(
        [sys.executable, "-m", "minimlx", "explain", "--html", str(out)], capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--html needs --prompt" in run.stderr


def test_the_adapter_panel_shows_the_base_against_the_adapted_walk(browser, adapted_llama, tmp_path):
    folder, adapter = adapted_llama
    model, tokenizer = minimlx.load(folder, "float32", adapter=adapter)
    explanation = minimlx.explain(model, tokenizer, "w3 w9 w27 w81 w50 w12", title="tiny llama + adapter")
    figures = explanation.walk["adapter"]
    explanation.save(path := tmp_path / "adapted.html")
    context = browser.new_context(offline=True)
    try:
        page = Page(context)
        page.page.goto(path.as_uri())
        page.page.wait_for_selector(".mx-explain[data-ready='1']")
        for position in (len(explanation.walk["ids"]) - 1, 2):
            page.page.click(f".mx-tokens .mx-token[data-position='{position}']")
            rows = page.page.locator("[data-panel=adapter] tr[data-layer]").evaluate_all(
                "rows => rows.map(r => [...r.querySelectorAll('td[data-figure]')].map(c => c.dataset))"
            )
            shown = [
                [
                    float(attn["before"]),
                    float(attn["after"]),
                    float(mlp["before"]),
                    float(mlp["after"]),
                    float(s["shift"]),
                ]
                for attn, mlp, s in rows
            ]
            keys = ("attn_before", "attn_after", "mlp_before", "mlp_after", "shift")
            assert shown == [[block[k][position] for k in keys] for block in figures["blocks"]]
        base = page.page.locator("[data-panel=adapter] [data-model=base] .mx-next-row")
        assert base.evaluate_all("r => r.map(e => Number(e.dataset.id))") == [
            n["id"] for n in figures["next_base"][:10]
        ]
        assert page.errors == []
    finally:
        context.close()
