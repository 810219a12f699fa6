"""Gemma 3 with images: the image processor's pixels, the SigLIP tower's soft tokens, the logits of a prompt holding
images (their tokens seeing each other both ways) and greedy generation, against transformers on a tiny random
Gemma3ForConditionalGeneration saved with its processor."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error, require
from vision_models import IMAGE_START, IMAGE_TOKEN, TOKENS_PER_IMAGE, image_prompt, pictures, save_gemma3_image_text

import minimlx
from minimlx.core.vision import ImageInput, PlacedImages
from minimlx.errors import InvalidSettingError
from minimlx.vision import FixedSizeImages

TEXT_IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, torch model, transformers image processor, minimlx model in float32)."""
    folder = tmp_path_factory.mktemp("gemma3-image-text")
    torch_model, processor = save_gemma3_image_text(folder)
    return folder, torch_model, processor, minimlx.load_model(folder, dtype="float32")


def reference_pixels(processor, images) -> np.ndarray:
    return processor(images=images, return_tensors="np")["pixel_values"]


def reference_logits(torch_model, ids, pixels, both_ways: bool = True) -> np.ndarray:
    torch = require("torch")
    ids = torch.tensor([ids])
    token_types = (ids == IMAGE_TOKEN).long() if both_ways else None
    with torch.no_grad():
        return torch_model(input_ids=ids, pixel_values=torch.tensor(pixels), token_type_ids=token_types).logits.numpy()


def test_pixels_equal_the_processors_for_images_of_three_shapes(gemma3):
    folder, _, processor, _ = gemma3
    images = pictures()
    ours = np.stack([image.pixels for image in FixedSizeImages.from_folder(folder)(images)])
    assert ours.shape == (3, 3, 56, 56) and ours.dtype == np.float32
    assert np.abs(ours - reference_pixels(processor, images)).max() <= 1e-5


@pytest.mark.parametrize("suffix", ["png", "jpeg", "webp", "gif"])
def test_picture_files_decode_as_pillow_reads_them(gemma3, tmp_path, suffix):
    """Each format from its file (a GIF's first frame, its palette turned to RGB) gives the processor's pixels."""
    from PIL import Image

    folder, _, processor, _ = gemma3
    path = tmp_path / f"picture.{suffix}"
    frames = pictures([(45, 70), (45, 70)], seed=3)
    frames[0].save(path, save_all=suffix == "gif", append_images=frames[1:] if suffix == "gif" else [])
    ours = FixedSizeImages.from_folder(folder)([path])[0].pixels[None]
    with Image.open(path) as image:
        image.seek(0)
        assert np.abs(ours - reference_pixels(processor, [image.convert("RGB")])).max() <= 1e-5


def test_image_features_equal_transformers(gemma3):
    torch = require("torch")
    _, torch_model, processor, model = gemma3
    pixels = reference_pixels(processor, pictures())
    with torch.no_grad():
        reference = torch_model.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    ours = np.array(model.encode_images([ImageInput(p) for p in pixels])).reshape(3, TOKENS_PER_IMAGE, 64)
    assert relative_error(ours, reference) <= 1e-4


def test_logits_of_a_prompt_with_two_images_equal_transformers(gemma3):
    """Two images of 16 soft tokens each, in a model whose local layers see 8 tokens: each image's tokens see each
    other both ways, within the window in the local layers; with a cache or without."""
    _, torch_model, processor, model = gemma3
    ids = model.config.expand_images(image_prompt(TEXT_IDS, 2))
    assert ids.count(IMAGE_TOKEN) == 2 * TOKENS_PER_IMAGE
    pixels = reference_pixels(processor, pictures()[:2])
    reference = reference_logits(torch_model, ids, pixels)
    features = model.encode_images([ImageInput(p) for p in pixels])
    placed = PlacedImages.at(ids, IMAGE_TOKEN, features, [TOKENS_PER_IMAGE] * 2, both_ways=True)
    assert relative_error(np.array(model(mx.array([ids]), images=placed)), reference) <= 1e-4
    cached = np.array(model(mx.array([ids]), model.make_cache(), images=placed))
    assert relative_error(cached, reference) <= 1e-4
    assert relative_error(reference_logits(torch_model, ids, pixels, both_ways=False), reference) > 1e-2


def assert_greedy_ids_match(folder, torch_model, processor):
    torch = require("torch")
    model, tokenizer = minimlx.load(folder, dtype="float32")
    images = pictures()[1:]
    prompt = image_prompt(TEXT_IDS[:12], 2)
    ours = [r.token for r in minimlx.stream_generate(model, tokenizer, prompt, images=images, max_tokens=10)]
    ids = torch.tensor([model.config.expand_images(prompt)])
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=ids,
            pixel_values=torch.tensor(reference_pixels(processor, images)),
            token_type_ids=(ids == IMAGE_TOKEN).long(),
            max_new_tokens=10,
            do_sample=False,
        )
    theirs = out[0, ids.shape[1] :].tolist()
    assert len(ours) >= 2 and ours == theirs[: len(ours)]
    return model


def test_generate_with_images_gives_transformers_greedy_ids(gemma3):
    folder, torch_model, processor, _ = gemma3
    assert_greedy_ids_match(folder, torch_model, processor)


def test_a_text_prompts_images_are_written_out_once(gemma3):
    """Each start token not yet written out gets its blank lines, soft tokens and end token (Gemma3Processor's
    layout, checked against it in test_server_vision.py); a prompt written out already is kept."""
    config, start, end, soft = gemma3[3].config, "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    once = config.write_images_text(f"Compare {start} with {start}.")
    assert once.count(soft) == 2 * TOKENS_PER_IMAGE and once.count(f"{end}\n\n") == once.count(f"\n\n{start}") == 2
    assert config.write_images_text(once) == once
    assert config.write_images_text(f"a {start}{soft * 3} b") == f"a {start}{soft * 3} b"


def test_generate_with_images_over_fixed_capacity_caches(tmp_path):
    """A model of global layers only decodes over the compiled step's fixed-capacity caches, whose mask has room
    beyond the prompt."""
    from minimlx.decode.generate import make_cache

    torch_model, processor = save_gemma3_image_text(tmp_path, seed=1, layer_types=["full_attention"] * 4)
    model = assert_greedy_ids_match(tmp_path, torch_model, processor)
    assert {type(cache).__name__ for cache in make_cache(model)} == {"FixedKVCache"}


def test_images_need_their_places_in_the_prompt_and_an_image_text_model(gemma3, tmp_path):
    folder, *_ = gemma3
    model, tokenizer = minimlx.load(folder, dtype="float32")
    with pytest.raises(InvalidSettingError, match="image"):
        minimlx.generate(model, tokenizer, TEXT_IDS[:5] + [IMAGE_START], images=pictures()[:2], max_tokens=2)
    with pytest.raises(InvalidSettingError, match="no such image file"):
        minimlx.generate(model, tokenizer, TEXT_IDS[:5] + [IMAGE_START], images=[tmp_path / "x.png"], max_tokens=2)


def test_run_with_images_answers_as_generate_does(gemma3, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main

    folder, *_ = gemma3
    paths = []
    for i, picture in enumerate(pictures()[:2]):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        picture.save(tmp_path / f"{i}.png")
    prompt = " ".join(f"w{i}" for i in image_prompt(TEXT_IDS[:8], 2))
    options = ["--model", str(folder), "--dtype", "float32", "--no-chat-template", "--max-tokens", "6", "--temp", "0"]
    result = CliRunner().invoke(main, ["run", prompt, *options, *paths])
    assert result.exit_code == 0, result.output
    model, tokenizer = minimlx.load(folder, dtype="float32")
    images = [tmp_path / "0.png", tmp_path / "1.png"]
    answer = minimlx.generate(model, tokenizer, prompt, chat_template=False, images=images, max_tokens=6)
    assert answer and result.stdout.strip() == answer.strip()


def test_run_with_a_missing_image_says_so_in_one_line(tmp_path):
    from click.testing import CliRunner
    from command_line import one_line_error

    from minimlx.cli import main

    result = CliRunner().invoke(main, ["run", "hi", "--image", str(tmp_path / "absent.png")])
    one_line_error(result, "--image", "absent.png", "no such file")


def test_run_refuses_images_past_its_limits_in_one_line(gemma3, tmp_path):
    from click.testing import CliRunner
    from command_line import one_line_error

    from minimlx.cli import main

    folder, *_ = gemma3
    paths = []
    for i, picture in enumerate(pictures()[:2]):
        picture.save(tmp_path / f"{i}.png")
        paths += ["--image", str(tmp_path / f"{i}.png")]
    prompt = " ".join(f"w{i}" for i in image_prompt(TEXT_IDS[:8], 2))
    options = ["--model", str(folder), "--no-chat-template", "--max-tokens", "2"]
    result = CliRunner().invoke(main, ["run", prompt, *options, *paths, "--max-images", "1"])
    one_line_error(result, "2 images came, more than the 1")
    result = CliRunner().invoke(main, ["run", prompt, *options, *paths, "--max-image-pixels", "1000"])
    one_line_error(result, "more than the 1,000 read")


def test_the_published_layout_loads_as_transformers_5s_does(gemma3, tmp_path):
    """The tensors written back (the published checkpoints' names: `vision_tower.vision_model.*`, the patch kernel
    (dims, channels, p, p)) load into the same soft tokens."""
    import shutil

    from mlx.utils import tree_flatten

    folder, _, processor, model = gemma3
    written = model.config.export_weights(dict(tree_flatten(model.parameters())))
    assert written["vision_tower.vision_model.embeddings.patch_embedding.weight"].shape == (32, 3, 7, 7)
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), written)
    pixels = [ImageInput(p) for p in reference_pixels(processor, pictures())]
    published = minimlx.load_model(tmp_path, dtype="float32")
    assert np.array_equal(np.array(published.encode_images(pixels)), np.array(model.encode_images(pixels)))


def test_a_converted_folder_keeps_the_tower_and_the_image_processor(gemma3, tmp_path):
    """`convert` writes the vision tower and copies the image processor's settings: the converted folder answers an
    image prompt as its source does."""
    from minimlx.convert import convert

    folder, *_ = gemma3
    convert(folder, tmp_path / "converted", dtype="float32")
    assert (tmp_path / "converted" / "preprocessor_config.json").is_file()
    prompt, images = image_prompt(TEXT_IDS[:8], 2), pictures()[:2]
    answers = []
    for path in (folder, tmp_path / "converted"):
        model, tokenizer = minimlx.load(path, dtype="float32")
        answers.append(minimlx.generate(model, tokenizer, prompt, images=images, max_tokens=6))
    assert answers[0] and answers[1] == answers[0]


def test_encoded_images_keep_the_latest_within_their_bytes(gemma3, monkeypatch):
    """EncodedImages gives the encoder's soft tokens, encodes only the images it does not keep, and keeps the most
    recently used within its bytes."""
    from minimlx.decode.images import EncodedImages

    *_, model = gemma3
    inputs = FixedSizeImages.from_folder(gemma3[0])(pictures())
    digests, places = [image.digest for image in inputs], [TOKENS_PER_IMAGE] * 3
    expected = np.array(model.encode_images(inputs))
    calls = []
    encode = type(model).encode_images
    monkeypatch.setattr(
        type(model), "encode_images", lambda self, images: calls.append(len(images)) or encode(self, images)
    )
    one = expected.nbytes // 3
    kept = EncodedImages(max_bytes=2 * one)
    assert np.allclose(np.array(kept(model, inputs[:2], digests[:2], places[:2])), expected[: 2 * TOKENS_PER_IMAGE])
    assert np.allclose(np.array(kept(model, inputs, digests, places)), expected, atol=1e-6)
    assert calls == [2, 1] and kept.bytes == 2 * one and list(kept.entries) == [digests[1], digests[2]]
    kept(model, inputs[::-1], digests[::-1], places)  # the second and third kept, the first encoded again
    assert calls == [2, 1, 1] and list(kept.entries) == [digests[1], digests[0]]
