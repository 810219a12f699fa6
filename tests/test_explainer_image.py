"""The explainer's image panel (`minimlx explain --image`) in headless Chromium, on the tiny random Gemma 3 of
vision_models.py: the page shows the picture with its soft tokens' grid, the heatmap over it is `trace`'s attention
weights from the chosen token to the image's soft tokens (with the image in place), and the lens and next-token
figures are those of the image-conditioned prompt."""

import json

import mlx.core as mx
import pytest
from explain_browser import Explained, Page, chromium
from vision_models import gemma3_processor, pictures, save_gemma3_chat

import minimlx
from minimlx.anatomy.lens import top_guesses
from minimlx.explainer.images import ExplainedImage

pytestmark = pytest.mark.slow  # a browser

PROMPT = "What is it?"


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    """(model, tokenizer, the page after walking PROMPT, its ExplainedImage, the picture's path, Gemma3Processor's ids
    of the picture before PROMPT)."""
    folder = tmp_path_factory.mktemp("gemma3-explain")
    _, image_processor = save_gemma3_chat(folder)
    model, tokenizer = minimlx.load(folder, dtype="float32")
    path = folder / "picture.png"
    pictures([(40, 72)])[0].save(path)
    image = ExplainedImage.read(model, tokenizer, path)
    processor = gemma3_processor(folder, image_processor)
    expected = processor(text=f"<start_of_image>{PROMPT}", images=pictures([(40, 72)]))["input_ids"][0]
    server = Explained(model, tokenizer, "tiny-gemma3", image=image)
    playwright, browser = chromium()
    page = Page(browser, server.url + "/")
    page.explain(PROMPT)
    yield model, tokenizer, page, image, path, expected
    browser.close()
    playwright.stop()
    server.stop()


def shown_heatmap(page: Page) -> tuple[dict, mx.array]:
    canvas = page.page.locator("canvas.mx-image-heat")
    attrs = {k: int(canvas.get_attribute(f"data-{k}")) for k in ("layer", "head", "position")}
    return attrs, mx.array(json.loads(canvas.get_attribute("data-weights")))


def test_the_heatmap_over_the_image_is_traces_attention_to_its_soft_tokens(explained):
    model, tokenizer, page, image, _, expected = explained
    p = page.page
    ids = p.locator(".mx-tokens .mx-token").evaluate_all("t => t.map(e => Number(e.dataset.id))")
    assert ids == expected  # the picture before the text, written out as Gemma 3's processor writes it
    start, stop = ids.index(model.config.image_token), len(ids) - ids[::-1].index(model.config.image_token)
    assert stop - start == 16 and p.locator(".mx-image-token").count() == 16
    assert json.loads(p.locator("canvas.mx-image-heat").get_attribute("data-grid")) == [4, 4]
    assert p.locator("[data-panel=image] img").get_attribute("src").startswith("data:image/png;base64,")

    checked = 0
    for layer, head, position in [(2, 1, len(ids) - 1), (0, 3, stop + 1), (1, 0, start + 5)]:  # global, local layers
        p.select_option("select[name=layer]", str(layer))
        p.click(f"canvas[data-layer='{layer}'][data-head='{head}']")
        p.click(f".mx-tokens .mx-token[data-position='{position}']")
        p.wait_for_function(
            f"(c => c && c.dataset.position === '{position}' && c.dataset.layer === '{layer}' && "
            f"c.dataset.head === '{head}')(document.querySelector('canvas.mx-image-heat'))"
        )
        attrs, weights = shown_heatmap(page)
        assert attrs == {"layer": layer, "head": head, "position": position}
        name = f"layers.{layer}.attn_weights"
        traced = minimlx.trace(model, ids, [name], images=image.placed(ids))[name][0, head, position, start:stop]
        assert weights.shape == (4, 4)
        assert mx.abs(weights - traced.reshape(4, 4)).max().item() < 1e-4
        checked += mx.sum(traced).item() > 1e-3  # the token reads the image (not a map of zeros)
    assert checked >= 2
    assert page.errors == []


def test_the_lens_and_next_token_are_the_image_conditioned_prompts(explained, tmp_path):
    model, tokenizer, page, image, path, _ = explained
    ids = page.page.locator(".mx-tokens .mx-token").evaluate_all("t => t.map(e => Number(e.dataset.id))")
    names = ["embed"] + [f"layers.{i}.resid_post" for i in range(len(model.layers))] + ["logits"]
    values = minimlx.trace(model, ids, names, images=image.placed(ids))
    stream = mx.stack([values[n][0] for n in names[:-1]])
    top_ids, _ = top_guesses(model, stream, 1)
    shown = page.lens_tokens()
    assert len(shown) == (len(model.layers) + 1) * len(ids)
    assert all(shown[r, q] == tokenizer.decode([top_ids[r][q][0]]) for r, q in shown)
    probs = mx.softmax(values["logits"][0, -1], axis=-1)
    page_probs = page.next_probs()
    assert page_probs and all(abs(q - probs[i].item()) < 1e-4 for i, q in page_probs.items())
    other = ExplainedImage.read(model, tokenizer, pictures([(64, 30)], seed=5)[0])
    elsewhere = minimlx.trace(model, ids, ["logits"], images=other.placed(ids))["logits"][0, -1]
    assert mx.abs(mx.softmax(elsewhere, axis=-1) - probs).max().item() > 1e-3  # the picture matters

    page_file = tmp_path / "walk.html"
    minimlx.explain(model, tokenizer, PROMPT, image=path).save(page_file)  # the standalone page carries the panel
    assert '"grid": [4, 4]' in page_file.read_text()


def test_bad_images_are_one_line(explained, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main
    from minimlx.errors import InvalidSettingError

    model, tokenizer, _, image, path, _ = explained
    args = ["explain", "--image", str(tmp_path / "none.png"), "--html", str(tmp_path / "x.html"), "--prompt", "a"]
    missing = CliRunner().invoke(main, args)
    assert missing.exit_code == 2 and "no such image file" in missing.output
    start = image.start_text
    with pytest.raises(InvalidSettingError, match="holds 2 image"):
        image.ids(tokenizer.encode(f"{start}a{start}b"), 256)
    with pytest.raises(InvalidSettingError, match="at most 8"):
        image.ids(tokenizer.encode(image.prompt("a long question")), 8)
