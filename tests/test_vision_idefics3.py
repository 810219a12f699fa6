"""Idefics3 and SmolVLM with images: the tiling image processor's pixels, the prompt's tile tokens, the logits of a
prompt holding three tiled pictures and greedy generation through `minimlx run --image`, against transformers on
tiny random checkpoints saved with their processor; and mlx-vlm's folder layout."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error, require
from vision_models import IDEFICS3_SHAPES, IDEFICS3_TOKENS_PER_TILE, pictures, save_idefics3

import minimlx
from minimlx.core.vision import PlacedImages
from minimlx.decode.images import PromptImages
from minimlx.vision import TiledImages

PROMPT = "User:<image>What is<image> this?\n<image><end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def idefics3(idefics3_chat):
    """(folder, torch model, transformers processor, minimlx model and tokenizer in float32)."""
    return *idefics3_chat, *minimlx.load(idefics3_chat[0], dtype="float32")


def reference_inputs(processor, images, prompt=PROMPT):
    return processor(text=prompt, images=[images], return_tensors="pt")


@pytest.mark.parametrize("split", [True, False])
def test_pixels_equal_the_processors_for_pictures_of_three_shapes(split):
    """Each picture's tiles (row by row, then the global image) equal the processor's, whose padding mask covers
    every tile whole; without splitting, one tile."""
    transformers = require("transformers")
    reference = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=split
    )
    ours = TiledImages.from_config(reference.to_dict())
    for image, picture in zip(ours(pictures(IDEFICS3_SHAPES)), pictures(IDEFICS3_SHAPES)):
        theirs = reference(images=[picture], return_tensors="np", return_row_col_info=True)
        assert image.grid == (theirs["rows"][0][0], theirs["cols"][0][0])
        assert image.pixels.shape == theirs["pixel_values"].shape[1:] and image.pixels.dtype == np.float32
        assert np.abs(image.pixels - theirs["pixel_values"][0]).max() <= 1e-5
        assert theirs["pixel_attention_mask"].all()
    assert [image.grid for image in ours(pictures(IDEFICS3_SHAPES))] == (
        [(1, 2), (2, 2), (2, 2)] if split else [(0, 0)] * 3
    )


def test_prompt_places_and_logits_equal_the_processors_and_transformers(idefics3):
    """The prompt's `<image>`s written out as the processor writes them (tile tokens, newlines, the global image);
    the logits of that prompt with the three pictures' soft tokens in place equal transformers', and differ from
    those without the pictures."""
    torch = require("torch")
    _, torch_model, processor, model, tokenizer = idefics3
    images = pictures(IDEFICS3_SHAPES)
    reference = reference_inputs(processor, images)
    inputs = model.image_processor(images)
    ids = model.config.expand_images(tokenizer.encode(PROMPT, add_special_tokens=False), inputs)
    assert ids == reference["input_ids"][0].tolist() and model.config.expand_images(ids, inputs) == ids  # kept
    assert ids.count(model.config.image_token) == IDEFICS3_TOKENS_PER_TILE * (3 + 5 + 5)
    with torch.no_grad():
        theirs = torch_model(**reference).logits.numpy()
    places = [model.config.image_places(image) for image in inputs]
    placed = PlacedImages.at(ids, model.config.image_token, model.encode_images(inputs), places, both_ways=False)
    ours = np.array(model(mx.array([ids]), images=placed))
    assert relative_error(ours, theirs) <= 1e-4
    assert relative_error(np.array(model(mx.array([ids]))), theirs) > 1e-2
    written, prompt = PromptImages.read(model, tokenizer.encode(PROMPT, add_special_tokens=False), images)
    keyed = prompt.keyed(written)  # each tile's places keyed by its own picture's digest
    assert written == ids and [k < 0 for k in keyed] == [t == model.config.image_token for t in ids]


def test_pictures_left_whole_are_written_as_the_processor_writes_them(idefics3):
    """Without splitting, each `<image>` becomes the global image's tokens alone, as the processor writes it."""
    transformers = require("transformers")
    _, _, processor, model, tokenizer = idefics3
    whole = transformers.Idefics3ImageProcessorPil(
        **{**processor.image_processor.to_dict(), "do_image_splitting": False}
    )
    reference = transformers.Idefics3Processor(whole, processor.tokenizer, image_seq_len=IDEFICS3_TOKENS_PER_TILE)
    inputs = TiledImages.from_config(whole.to_dict())(pictures(IDEFICS3_SHAPES))
    ids = model.config.expand_images(tokenizer.encode(PROMPT, add_special_tokens=False), inputs)
    assert ids == reference(text=PROMPT, images=[pictures(IDEFICS3_SHAPES)])["input_ids"][0]
    assert [model.config.image_runs(image) for image in inputs] == [(IDEFICS3_TOKENS_PER_TILE,)] * 3


def test_run_with_three_images_gives_transformers_greedy_ids(idefics3, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main

    torch = require("torch")
    folder, torch_model, processor, model, tokenizer = idefics3
    images = pictures(IDEFICS3_SHAPES)
    reference = reference_inputs(processor, images)
    with torch.no_grad():
        out = torch_model.generate(**reference, max_new_tokens=8, do_sample=False)
    theirs = out[0, reference["input_ids"].shape[1] :].tolist()
    ours = [
        r.token
        for r in minimlx.stream_generate(model, tokenizer, PROMPT, chat_template=False, images=images, max_tokens=8)
    ]
    assert len(set(ours)) > 2 and ours == theirs[: len(ours)]
    paths = []
    for i, picture in enumerate(images):
        picture.save(tmp_path / f"{i}.png")
        paths += ["--image", str(tmp_path / f"{i}.png")]
    options = ["--model", str(folder), "--dtype", "float32", "--no-chat-template", "--max-tokens", "8", "--temp", "0"]
    result = CliRunner().invoke(main, ["run", PROMPT, *options, *paths])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == tokenizer.decode(theirs)


def test_smolvlm_from_mlx_vlms_folder_layout_equals_transformers(tmp_path):
    """A SmolVLM checkpoint (model_type smolvlm) rewritten in mlx-vlm's layout (no `model.` prefix, the text model
    under `language_model.` with its head, the patch kernel channels-last) gives transformers' soft tokens."""
    import shutil

    torch = require("torch")
    torch_model, processor = save_idefics3(tmp_path / "hf", "SmolVLM", seed=1)
    layout = tmp_path / "mlx-vlm"
    layout.mkdir()
    weights = {}
    for name, value in mx.load(str(tmp_path / "hf" / "model.safetensors")).items():
        name = name.removeprefix("model.").replace("text_model.", "language_model.")
        name = "language_model." + name if name.startswith("lm_head.") else name
        weights[name] = value.transpose(0, 2, 3, 1) if name.endswith("patch_embedding.weight") else value
    mx.save_safetensors(str(layout / "model.safetensors"), weights)
    for file in (tmp_path / "hf").iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, layout / file.name)
    model = minimlx.load_model(layout, dtype="float32")
    assert model.config.image_text_type == "idefics3" and not model.tied_head
    images = pictures(IDEFICS3_SHAPES[:1])
    pixels = processor(text="<image>", images=[images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = torch_model.model.get_image_features(pixels).pooler_output[0].numpy()
    ours = np.array(model.encode_images(TiledImages.from_config(processor.image_processor.to_dict())(images)))
    assert relative_error(ours, theirs) <= 1e-4
