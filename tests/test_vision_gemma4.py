"""Gemma 4 with images: its processor's pixels (each picture at its own aspect, within a patch budget), the tower's
soft tokens (learned column and row embeddings, axial 2D RoPE, 2 x 2 pooling) for several pictures in one pass, the
prompt's layout, logits with the image tokens seeing each other both ways in the sliding layers only, and greedy
generation through `minimlx run --image`, against transformers on a tiny random Gemma4ForConditionalGeneration saved
with its image processor."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error, require
from vision_models import (
    GEMMA4_END,
    GEMMA4_IMAGE,
    GEMMA4_START,
    check_run_with_images,
    gemma4_inputs,
    pictures,
    save_gemma4_image_text,
)

import minimlx

SHAPES = [(37, 91), (120, 64), (20, 30)]  # (height, width): wide and small (scaled up), tall (scaled down), small


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(folder, torch model, transformers image processor, minimlx model in float32, tokenizer, the pictures)."""
    folder = tmp_path_factory.mktemp("gemma4-image-text")
    torch_model, processor = save_gemma4_image_text(folder, seed=1)
    model, tokenizer = minimlx.load(folder, dtype="float32")
    return folder, torch_model, processor, model, tokenizer, pictures(SHAPES, seed=5)


def test_pixels_equal_the_processors_for_pictures_of_three_sizes(gemma4):
    _, _, processor, model, _, images = gemma4
    reference = gemma4_inputs(processor, images)
    ours = model.image_processor(images)
    assert [image.grid for image in ours] == [(10, 26), (22, 12), (12, 20)]
    assert [model.config.image_places(image) for image in ours] == reference["soft_tokens"] == [65, 66, 60]
    for image, padded in zip(ours, reference["pixel_values"].numpy()):
        assert image.pixels.dtype == np.float32
        assert np.abs(image.pixels - padded[: len(image.pixels)]).max() <= 1e-5


def test_soft_tokens_of_three_pictures_in_one_pass_equal_transformers(gemma4):
    torch = require("torch")
    _, torch_model, processor, model, _, images = gemma4
    reference = gemma4_inputs(processor, images)
    with torch.no_grad():
        theirs = torch_model.model.get_image_features(
            reference["pixel_values"], reference["image_position_ids"]
        ).pooler_output
    inputs = model.image_processor(images)
    ours = np.array(model.encode_images(inputs))
    assert ours.shape == (65 + 66 + 60, 64)
    assert relative_error(ours, np.concatenate([t.numpy() for t in theirs])) <= 1e-4
    assert relative_error(np.array(model.encode_images(inputs[1:2])), theirs[1].numpy()) <= 1e-4


def written_prompt(words: list[int], places: list[int]) -> list[int]:
    """`words` with each image token written out as Gemma 4's processor writes it for the next image of `places`."""
    ids, image = [], 0
    for word in words:
        if word == GEMMA4_IMAGE:
            ids += [GEMMA4_START, *[GEMMA4_IMAGE] * places[image], GEMMA4_END]
            image += 1
        else:
            ids.append(word)
    return ids


@pytest.mark.parametrize(
    "prompt", [[3, GEMMA4_IMAGE, 4, 5, GEMMA4_IMAGE, 6, GEMMA4_IMAGE, 7], [3] + [GEMMA4_IMAGE] * 3]
)
def test_prompt_layout_is_the_processors(gemma4, prompt):
    """Each image token written out for its image, those next to each other (a message's pictures without text
    between them) too; a prompt written out is kept."""
    _, _, _, model, _, images = gemma4
    inputs = model.image_processor(images)
    written = model.config.expand_images(prompt, inputs)
    assert written == written_prompt(prompt, [65, 66, 60])
    assert model.config.expand_images(written, inputs) == written  # written out: kept


def torch_logits(torch_model, ids, reference, both_ways=True):
    torch = require("torch")
    types = torch.tensor([[int(i == GEMMA4_IMAGE) for i in ids]])
    with torch.no_grad():
        return torch_model(
            input_ids=torch.tensor([ids]),
            pixel_values=reference["pixel_values"],
            image_position_ids=reference["image_position_ids"],
            mm_token_type_ids=types if both_ways else None,
        ).logits.numpy()


def test_logits_of_a_prompt_with_three_images_equal_transformers(gemma4):
    """The soft tokens stand at the image token's places; each image's tokens see each other both ways in the
    sliding layers (read causally, the logits differ), and read as the padding token for the per-layer inputs."""
    _, torch_model, processor, model, _, images = gemma4
    reference = gemma4_inputs(processor, images)
    ids = written_prompt([3, GEMMA4_IMAGE, 4, GEMMA4_IMAGE, 5, GEMMA4_IMAGE, 6], reference["soft_tokens"])
    inputs = model.image_processor(images)
    config = model.config
    assert config.images_both_ways and config.images_both_ways_windowed_only and config.image_stand_in == 0
    placed = config.place_images(ids, model.encode_images(inputs), [config.image_places(i) for i in inputs])
    ours = np.array(model(mx.array([ids]), model.make_cache(), images=placed))
    theirs = torch_logits(torch_model, ids, reference)
    assert relative_error(ours, theirs) <= 1e-4
    assert relative_error(torch_logits(torch_model, ids, reference, both_ways=False), theirs) > 1e-2


def test_the_explainers_image_panel_grids_the_pooled_tokens_and_its_walk_reads_the_picture(gemma4, tmp_path):
    """`explain --image` on Gemma 4: the panel's grid is the pooled soft tokens' over the picture's patches, and the
    walk's pass (the image in place) gives transformers' logits."""
    from minimlx.explainer.images import ExplainedImage

    _, torch_model, processor, model, tokenizer, images = gemma4
    images[0].save(tmp_path / "picture.png")
    image = ExplainedImage.read(model, tokenizer, tmp_path / "picture.png")
    ids = image.ids([3, GEMMA4_IMAGE, 4, 5], 256)
    reference = gemma4_inputs(processor, images[:1])
    assert ids == written_prompt([3, GEMMA4_IMAGE, 4, 5], reference["soft_tokens"])
    panel = image.panel(ids)
    assert (panel["patches"], panel["grid"]) == ([10, 26], [5, 13]) and panel["stop"] - panel["start"] == 65
    logits = minimlx.trace(model, ids, ["logits"], images=image.placed(ids))["logits"]
    assert relative_error(np.array(logits), torch_logits(torch_model, ids, reference)) <= 1e-4


def test_run_with_three_images_gives_transformers_greedy_ids(gemma4, tmp_path):
    """`minimlx run --image` three times (three sizes and aspects, two side by side) prints what transformers' greedy
    `generate` gives on the processor's pixels and layout."""
    torch = require("torch")
    folder, torch_model, processor, model, tokenizer, images = gemma4
    words = [3, 4, GEMMA4_IMAGE, GEMMA4_IMAGE, 5, 6, 7, GEMMA4_IMAGE, 8, 9]
    reference = gemma4_inputs(processor, images)
    ids = written_prompt(words, reference["soft_tokens"])
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=reference["pixel_values"],
            image_position_ids=reference["image_position_ids"],
            mm_token_type_ids=torch.tensor([[int(i == GEMMA4_IMAGE) for i in ids]]),
            max_new_tokens=8,
            do_sample=False,
        )
    theirs = out[0, len(ids) :].tolist()
    ours = [r.token for r in minimlx.stream_generate(model, tokenizer, words, images=images, max_tokens=8)]
    assert len(ours) >= 2 and ours == theirs[: len(ours)]
    check_run_with_images(folder, words, images, tokenizer.decode(ours), tmp_path)
