"""Mistral 3 with images: Pixtral's processor's pixels (each picture at its own size), the Pixtral encoder's and
projector's soft tokens for several pictures in one pass, the prompt's layout of [IMG], [IMG_BREAK] and [IMG_END],
and greedy generation through `minimlx run --image`, against transformers on a tiny random
Mistral3ForConditionalGeneration saved with its image processor."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error, require
from vision_models import (
    MISTRAL3_CHAT_TOKENS,
    MISTRAL3_SPECIALS,
    PIXTRAL_BREAK,
    PIXTRAL_END,
    PIXTRAL_IMAGE,
    check_run_with_images,
    pictures,
    pixtral_inputs,
    pixtral_layout,
    save_character_tokenizer,
    save_mistral3_image_text,
)

import minimlx

SHAPES = [(37, 91), (120, 64), (20, 30)]  # (height, width): wide, tall (both scaled down), small (kept, padded up)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    """(folder, torch model, transformers image processor, minimlx model in float32, the pictures)."""
    folder = tmp_path_factory.mktemp("mistral3-image-text")
    torch_model, processor = save_mistral3_image_text(folder, seed=2)  # a seed whose greedy ids follow the images
    model, tokenizer = minimlx.load(folder, dtype="float32")
    return folder, torch_model, processor, model, pictures(SHAPES, seed=5)


def test_pixels_equal_the_processors_for_pictures_of_three_sizes(mistral3):
    _, _, processor, model, images = mistral3
    reference = pixtral_inputs(processor, images)
    ours = model.image_processor(images)
    assert [image.pixels.shape[1:] for image in ours] == [tuple(size) for size in reference["image_sizes"]]
    assert [image.grid for image in ours] == [(3, 6), (6, 4), (3, 4)]
    for image, padded, (height, width) in zip(ours, reference["pixel_values"], reference["image_sizes"]):
        assert image.pixels.dtype == np.float32
        assert np.abs(image.pixels - padded[:, :height, :width]).max() <= 1e-5


def test_soft_tokens_of_three_pictures_in_one_pass_equal_transformers(mistral3):
    """Three pictures of different grids go through the encoder together (block-diagonal attention); each's soft
    tokens equal transformers' and those of the picture encoded alone."""
    torch = require("torch")
    _, torch_model, processor, model, images = mistral3
    reference = pixtral_inputs(processor, images)
    with torch.no_grad():
        theirs = torch_model.model.get_image_features(
            torch.tensor(reference["pixel_values"]), image_sizes=torch.tensor(reference["image_sizes"])
        ).pooler_output
    inputs = model.image_processor(images)
    ours = np.array(model.encode_images(inputs))
    assert ours.shape == (18 + 24 + 12, 64)
    assert relative_error(ours, np.concatenate([t.numpy() for t in theirs])) <= 1e-4
    alone = np.array(model.encode_images(inputs[1:2]))
    assert relative_error(alone, theirs[1].numpy()) <= 1e-4


@pytest.mark.parametrize(
    "prompt", [[3, PIXTRAL_IMAGE, 4, 5, PIXTRAL_IMAGE, 6, PIXTRAL_IMAGE, 7], [3] + [PIXTRAL_IMAGE] * 3]
)
def test_prompt_layout_is_the_processors(mistral3, prompt):
    """Each `[IMG]` written out for its image, those next to each other (a message's pictures without text between
    them) too; a prompt written out is kept."""
    _, _, processor, model, images = mistral3
    expected = written_prompt(prompt, pixtral_inputs(processor, images)["image_sizes"])
    written = model.config.expand_images(prompt, model.image_processor(images))
    assert written == expected and len(written) == len(prompt) - 3 + 3 * 7 + 6 * 5 + 3 * 5
    assert model.config.expand_images(written, model.image_processor(images)) == expected  # written out: kept


def test_image_break_and_end_ids_are_the_tokenizers_or_the_configs(mistral3, tmp_path):
    """Where the config does not name [IMG_BREAK] and [IMG_END] (Hugging Face's do not), their ids are the
    tokenizer's (here not tekken's 12 and 13); where it names them, the config's."""
    import json
    import shutil

    folder, _, processor, _, images = mistral3
    for name in ("model.safetensors", "preprocessor_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    save_character_tokenizer(tmp_path, MISTRAL3_SPECIALS)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    sizes = pixtral_inputs(processor, images[:1])["image_sizes"]
    model, _ = minimlx.load(tmp_path, dtype="float32")
    tokens = (PIXTRAL_IMAGE, *MISTRAL3_CHAT_TOKENS[1:])
    written = model.config.expand_images([3, PIXTRAL_IMAGE, 4], model.image_processor(images[:1]))
    assert written == [3, *pixtral_layout(*sizes[0], tokens), 4] and tokens[1:] != (PIXTRAL_BREAK, PIXTRAL_END)
    config |= dict(image_break_token_id=20, image_end_token_id=21)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = minimlx.load(tmp_path, dtype="float32")
    written = model.config.expand_images([3, PIXTRAL_IMAGE, 4], model.image_processor(images[:1]))
    assert written == [3, *pixtral_layout(*sizes[0], (PIXTRAL_IMAGE, 20, 21)), 4]


def written_prompt(words: list[int], sizes) -> list[int]:
    """`words` with each [IMG] written out for the next image of `sizes` as Mistral 3's processor writes it."""
    ids = []
    for word, image in zip(words, np.cumsum(np.array(words) == PIXTRAL_IMAGE) - 1):
        ids += pixtral_layout(*sizes[image]) if word == PIXTRAL_IMAGE else [word]
    return ids


def test_logits_of_a_prompt_with_three_images_equal_transformers(mistral3):
    """The soft tokens stand at the [IMG] places, row by row between the [IMG_BREAK]s; other images (the same sizes,
    other pixels) give other logits."""
    from minimlx.core.vision import PlacedImages

    torch = require("torch")
    _, torch_model, processor, model, images = mistral3
    reference = pixtral_inputs(processor, images)
    ids = written_prompt([3, PIXTRAL_IMAGE, 4, PIXTRAL_IMAGE, 5, PIXTRAL_IMAGE, 6], reference["image_sizes"])
    inputs = model.image_processor(images)
    places = [model.config.image_places(image) for image in inputs]
    placed = PlacedImages.at(ids, PIXTRAL_IMAGE, model.encode_images(inputs), places, both_ways=False)
    ours = np.array(model(mx.array([ids]), model.make_cache(), images=placed))
    with torch.no_grad():
        pixels, sizes = torch.tensor(reference["pixel_values"]), torch.tensor(reference["image_sizes"])
        theirs = torch_model(input_ids=torch.tensor([ids]), pixel_values=pixels, image_sizes=sizes).logits.numpy()
        others = torch_model(input_ids=torch.tensor([ids]), pixel_values=-pixels, image_sizes=sizes).logits.numpy()
    assert relative_error(ours, theirs) <= 1e-4
    assert relative_error(others, theirs) > 1e-2


def test_run_with_three_images_gives_transformers_greedy_ids(mistral3, tmp_path):
    """`minimlx run --image` three times (three sizes and aspects, two side by side) prints what transformers' greedy
    `generate` gives on the processor's pixels and the layout its processor writes."""
    torch = require("torch")
    folder, torch_model, processor, model, images = mistral3
    words = [3, 4, PIXTRAL_IMAGE, PIXTRAL_IMAGE, 5, 6, 7, PIXTRAL_IMAGE, 8, 9]
    reference = pixtral_inputs(processor, images)
    ids = written_prompt(words, reference["image_sizes"])
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.tensor(reference["pixel_values"]),
            image_sizes=torch.tensor(reference["image_sizes"]),
            max_new_tokens=8,
            do_sample=False,
        )
    theirs = out[0, len(ids) :].tolist()
    _, tokenizer = minimlx.load(folder, dtype="float32")
    ours = [r.token for r in minimlx.stream_generate(model, tokenizer, words, images=images, max_tokens=8)]
    assert len(ours) >= 2 and ours == theirs[: len(ours)]
    check_run_with_images(folder, words, images, tokenizer.decode(ours), tmp_path)


def mlx_vlm_name(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """mlx-vlm's name and layout of a tensor transformers saved: the tower under `vision_tower.vision_model.`, the
    patch kernel channels-last (dims, p, p, channels)."""
    if name == "vision_tower.patch_conv.weight":
        w = w.transpose(0, 2, 3, 1)
    return name.replace("vision_tower.", "vision_tower.vision_model."), w


def transformers_5_name(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """The name transformers 5 gives a tensor in memory (everything but the head under `model.`)."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model."), w
    return "model." + name.replace("language_model.model.", "language_model."), w


@pytest.mark.parametrize("rename", [mlx_vlm_name, transformers_5_name])
def test_other_layouts_load_into_the_same_model(mistral3, tmp_path, rename):
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, _, _, model, images = mistral3
    renamed = dict(rename(name, w) for name, w in load_file(str(folder / "model.safetensors")).items())
    save_file({name: np.ascontiguousarray(w) for name, w in renamed.items()}, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    theirs = minimlx.load_model(tmp_path, dtype="float32")
    inputs = model.image_processor(images)
    assert np.array_equal(np.array(theirs.encode_images(inputs)), np.array(model.encode_images(inputs)))
    ids = mx.array([[3, 4, 5]])
    assert np.array_equal(np.array(theirs(ids)), np.array(model(ids)))
