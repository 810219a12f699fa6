"""Gemma 3 and Qwen2.5-VL from llama.cpp's files: the text GGUF and the mmproj GGUF of its vision tower, both written
by llama.cpp's own converter (`--mmproj` for the second) from a tiny random image-text model saved by transformers
with a tiny SentencePiece vocabulary holding the family's image tokens. The pair (named with `mmproj=`, or found
beside the text file) gives the Hugging Face folder's soft tokens and greedy ids for a prompt with images."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error
from vision_models import QWEN_SHAPES, pictures

import minimlx
from minimlx.core.vision import PlacedImages
from minimlx.decode.images import PromptImages
from minimlx.errors import CheckpointError, InvalidSettingError

pytestmark = pytest.mark.slow  # llama.cpp's converter


@pytest.fixture(scope="module")
def pair(converted):
    """(the Hugging Face folder, the text GGUF, the mmproj GGUF beside it), converted to f32 with the other tiny
    models of llamacpp_models.py (`gemma3_vision_jobs`)."""
    root = converted / "gemma3-vision"
    return root / "hf", root / "gguf" / "gemma3-tiny-f32.gguf", root / "gguf" / "mmproj-gemma3-tiny-f32.gguf"


def test_the_text_and_mmproj_files_give_the_folders_soft_tokens_and_greedy_ids(pair, tmp_path):
    folder, text_file, mmproj = pair
    reference, tokenizer = minimlx.load(folder, dtype="float32")
    named, _ = minimlx.load(text_file, dtype="float32", mmproj=mmproj)
    found, _ = minimlx.load(text_file, dtype="float32")  # the mmproj*.gguf beside it
    images = pictures()[:2]
    inputs = reference.image_processor(images)
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(named.image_processor(images), inputs, strict=True))
    soft = np.array(reference.encode_images(inputs))
    # llama.cpp's converter stores the projection in float16: the soft tokens agree to its precision
    assert relative_error(np.array(named.encode_images(inputs)), soft) <= 1e-3
    assert np.array_equal(np.array(found.encode_images(inputs)), np.array(named.encode_images(inputs)))

    start = named.config.image_start_token
    assert start == reference.config.image_start_token and named.config.vision.tokens == 16
    ids = tokenizer.encode("The quick brown fox")
    prompt = ids[:2] + [start] + ids[2:3] + [start] + ids[3:]

    def greedy(model):
        steps = minimlx.stream_generate(model, tokenizer, prompt, images=images, max_tokens=8)
        return [r.token for r in steps]

    expected = greedy(reference)
    assert len(expected) >= 4 and greedy(named) == expected == greedy(found)

    def logits(model, pictures):  # the whole prompt's, its images' soft tokens in place
        ids, config = model.config.expand_images(prompt, pictures), model.config
        features = model.encode_images(pictures)
        placed = PlacedImages.at(ids, config.image_token, features, [16, 16], config.images_both_ways)
        return np.array(model(mx.array([ids]), images=placed))

    ours, theirs = logits(named, inputs), logits(reference, inputs)
    assert relative_error(ours, theirs) <= 1e-3
    assert relative_error(logits(reference, inputs[::-1]), theirs) > 2e-2  # the images matter to these logits

    text_only = tmp_path / text_file.name
    text_only.symlink_to(text_file)  # no mmproj beside it: the text model alone
    assert "vision" not in minimlx.load(text_only, dtype="float32")[0]
    with pytest.raises(CheckpointError, match="not an mmproj file"):
        minimlx.load(text_only, dtype="float32", mmproj=text_file)
    with pytest.raises(InvalidSettingError, match="goes with a .gguf text file"):
        minimlx.load(folder, dtype="float32", mmproj=mmproj)


def qwen_files(converted, family: str):
    """(the Hugging Face folder, the text GGUF, the mmproj GGUF beside it) of the tiny Qwen2.5-VL or Qwen2-VL
    (`qwen_vl_vision_jobs`)."""
    root = converted / "qwen-vision" / family
    return root / "hf", root / "gguf" / f"{family}-tiny-f32.gguf", root / "gguf" / f"mmproj-{family}-tiny-f32.gguf"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen_text_and_mmproj_files_give_the_folders_soft_tokens_and_greedy_ids(converted, pair, tmp_path, family):
    """The tower's settings the mmproj file does not hold (windows of 112 pixels, the full-attention blocks from
    n_wa_pattern, 8 to 4096 soft tokens a picture; Qwen2-VL's FFN width, which its feed_forward_length does not give)
    are taken as llama.cpp takes them, and the folder was saved with them; three pictures, one over two windows, one
    resized."""
    folder, text_file, mmproj = qwen_files(converted, family)
    reference, _ = minimlx.load(folder, dtype="float32")
    named, tokenizer = minimlx.load(text_file, dtype="float32", mmproj=mmproj)
    found, _ = minimlx.load(text_file, dtype="float32")  # the mmproj*.gguf beside it
    assert named.config.vision == reference.config.vision and type(named.config) is type(reference.config)
    images = pictures(QWEN_SHAPES)
    inputs = reference.image_processor(images)
    mine = named.image_processor(images)
    grids = [(1, 8, 12), (1, 18, 10), (1, 42, 28)]  # 9 rows of merge blocks: Qwen2.5-VL's two windows of 8
    assert [i.grid for i in mine] == grids
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(mine, inputs, strict=True))
    soft = np.array(reference.encode_images(inputs))
    assert relative_error(np.array(named.encode_images(inputs)), soft) <= 1e-5
    assert np.array_equal(np.array(found.encode_images(inputs)), np.array(named.encode_images(inputs)))

    image = "<|vision_start|><|image_pad|><|vision_end|>"  # as Qwen's chat template writes an image
    prompt = tokenizer.encode(f"The quick {image} brown {image} fox {image} jumps")

    def image_tokens(config):
        return [config.image_start_token, config.image_token, config.image_end_token]

    tokens = image_tokens(named.config)
    assert tokens == image_tokens(reference.config)
    assert sum(prompt[i : i + 3] == tokens for i in range(len(prompt))) == 3  # the text file's tokenizer

    def greedy(model):
        return [r.token for r in minimlx.stream_generate(model, tokenizer, prompt, images=images, max_tokens=8)]

    expected = greedy(reference)
    assert len(expected) >= 4 and greedy(named) == expected == greedy(found)

    def last_logits(model, pictures):
        ids, placed = PromptImages.read(model, prompt, pictures)
        return np.array(placed.prefill_prompt(model, ids, model.make_cache()))

    theirs = last_logits(reference, images)
    assert relative_error(last_logits(named, images), theirs) <= 1e-5
    assert relative_error(last_logits(reference, images[::-1]), theirs) > 1e-2  # the images matter to these logits

    text_only = tmp_path / text_file.name
    text_only.symlink_to(text_file)  # no mmproj beside it: the text model alone, as the folder's
    alone, _ = minimlx.load(text_only, dtype="float32")
    words = tokenizer.encode("The quick brown fox")
    assert "vision" not in alone
    assert relative_error(np.array(alone(mx.array([words]))), np.array(reference(mx.array([words])))) <= 1e-5
    with pytest.raises(CheckpointError, match="for gemma3 text files, not qwen2vl"):
        minimlx.load(text_file, dtype="float32", mmproj=pair[2])
