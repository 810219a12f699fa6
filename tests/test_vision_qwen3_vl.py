"""Qwen3-VL and Qwen3.5 with images (Qwen3-VL's tower: learned positions resampled to each grid, DeepStack levels
added after the first text layers; an interleaved multimodal RoPE), against transformers on tiny random checkpoints
saved with their processor (`save_qwen3_image_text`, over the character tokenizer): pixels, soft tokens and DeepStack
features, the logits after three images of different sizes read through the caches, and the greedy ids of
`minimlx run --image` (Qwen3-VL) and `stream_generate` (Qwen3.5 and both MoE variants) against `generate`."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error, require
from vision_models import (
    CHAT_IMAGE_START,
    CHAT_IMAGE_TOKEN,
    EOS,
    QWEN_SHAPES,
    pictures,
    qwen_inputs,
    save_qwen3_image_text,
)

import minimlx
from minimlx.decode.images import PromptImages

pytestmark = pytest.mark.slow  # transformers models are built (3-5 s each)
TEXT_IDS = list(range(3, 40))  # characters


def image_prompt(text_ids: list[int], images: int, before: int = 3) -> list[int]:
    """`text_ids` with `images` vision start tokens, each after `before` text tokens."""
    out = []
    for i in range(images):
        out += text_ids[i * before : (i + 1) * before] + [CHAT_IMAGE_START]
    return out + text_ids[images * before :]


def torch_image_inputs(ids: list[int], processor, images) -> dict:
    torch = require("torch")
    ids = torch.tensor([ids])
    return dict(input_ids=ids, mm_token_type_ids=(ids == CHAT_IMAGE_TOKEN).int(), **qwen_inputs(processor, images))


def assert_logits_after_images_match(torch_model, processor, model, images) -> None:
    """The prompt's images fed in one pass (soft tokens and DeepStack levels in place, positions on their grids), then
    its last four tokens one by one from the caches (positions shifted): their logits equal transformers'."""
    ids, placed = PromptImages.read(model, image_prompt(TEXT_IDS, len(images)) + [50, 60, 70], images)
    with require("torch").no_grad():
        reference = torch_model(**torch_image_inputs(ids, processor, images)).logits[0, -4:].numpy()
    cache = model.make_cache()
    placed.feed(model, ids[:-4], cache)
    steps = np.stack([np.array(model(mx.array([[token]]), cache))[0, -1] for token in ids[-4:]])
    assert relative_error(steps, reference) <= 1e-4


def transformers_greedy(torch_model, processor, model, prompt: list[int], images, tokens: int) -> list[int]:
    ids = model.config.expand_images(prompt, model.image_processor(images))
    with require("torch").no_grad():
        out = torch_model.generate(**torch_image_inputs(ids, processor, images), max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_qwen3_vl_pixels_features_logits_and_run_equal_transformers(qwen3_vl_chat, tmp_path):
    """Three pictures resized to grids of 8 x 12, 18 x 10 and 16 x 10 patches (the last resized down), the 4 x 4
    table of learned positions resampled to each; two DeepStack levels."""
    from click.testing import CliRunner
    from mlx.utils import tree_flatten

    from minimlx.cli import main

    torch = require("torch")
    folder, torch_model, processor = qwen3_vl_chat
    model, tokenizer = minimlx.load(folder, dtype="float32")
    images = pictures(QWEN_SHAPES)
    ours = model.image_processor(images)
    theirs = processor(images=images, return_tensors="np")
    assert theirs["image_grid_thw"].tolist() == [[1, 8, 12], [1, 18, 10], [1, 16, 10]]
    assert [list(image.grid) for image in ours] == theirs["image_grid_thw"].tolist()
    assert np.abs(np.concatenate([image.pixels for image in ours]) - theirs["pixel_values"]).max() <= 1e-5
    with torch.no_grad():
        out = torch_model.model.get_image_features(**qwen_inputs(processor, images))
    levels = [torch.cat(list(out.pooler_output))] + [torch.cat(list(level)) for level in out.deepstack_features]
    features = np.array(model.encode_images(ours))
    assert features.shape == (3, 24 + 45 + 40, 64)
    assert relative_error(features, np.stack([level.numpy() for level in levels])) <= 1e-5
    assert_logits_after_images_match(torch_model, processor, model, images)
    weights = dict(tree_flatten(model.parameters()))  # what `convert` writes reads back as the same model
    back = model.config.convert_weights(model.config.export_weights(weights))
    assert set(back) == set(weights) and all(mx.array_equal(back[k], weights[k]) for k in weights)

    paths = []
    for i, picture in enumerate(images):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        picture.save(tmp_path / f"{i}.png")
    prompt = "<start_of_image>".join(["Look: ", ", then ", " and ", ". Which?"])
    options = ["--model", str(folder), "--dtype", "float32", "--no-chat-template", "--max-tokens", "8", "--temp", "0"]
    result = CliRunner().invoke(main, ["run", prompt, *options, *paths])
    assert result.exit_code == 0, result.output
    expected = transformers_greedy(torch_model, processor, model, tokenizer.encode(prompt), images, 8)
    answer = tokenizer.decode([t for t in expected if t != EOS])
    assert answer.strip() and result.stdout.strip() == answer.strip()


@pytest.mark.parametrize("family", ["Qwen3_5", "Qwen3VLMoe", "Qwen3_5Moe"])
def test_qwen3_5_and_the_moe_variants_pixels_logits_and_greedy_ids_equal_transformers(family, tmp_path):
    """Qwen3.5 (its hybrid text model: a DeltaNet layer and a gated attention layer turning half of each head, reading
    Qwen3-VL's tower's soft tokens without DeepStack), Qwen3-VL-MoE (its chosen experts' weights always renormalised,
    one DeepStack level) and Qwen3.5-MoE, with the three pictures of 8 x 12, 18 x 10 and 16 x 10 patches (the last
    resized down)."""
    torch_model, processor = save_qwen3_image_text(tmp_path, family, chat=True)
    model, tokenizer = minimlx.load(tmp_path, dtype="float32")
    images = pictures(QWEN_SHAPES)
    pixels = np.concatenate([image.pixels for image in model.image_processor(images)])
    assert np.abs(pixels - processor(images=images, return_tensors="np")["pixel_values"]).max() <= 1e-5
    assert_logits_after_images_match(torch_model, processor, model, images)
    prompt = image_prompt(TEXT_IDS[:14], 3)
    ours = [r.token for r in minimlx.stream_generate(model, tokenizer, prompt, images=images, max_tokens=8)]
    assert len(ours) >= 2 and ours == transformers_greedy(torch_model, processor, model, prompt, images, 8)[: len(ours)]


def test_a_folder_without_the_tower_reads_its_text_model(qwen3_vl_chat, tmp_path):
    """A text-only conversion (mlx-lm's drops the tower but keeps the config's vision_config): the text model is
    read and answers as the whole checkpoint's does on text."""
    import shutil

    folder = qwen3_vl_chat[0]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k: v for k, v in weights.items() if "visual" not in k})
    text_only, whole = minimlx.load_model(tmp_path, "float32"), minimlx.load_model(folder, "float32")
    assert "vision" not in text_only and "vision" in whole
    ids = mx.array([TEXT_IDS])
    assert relative_error(np.array(text_only(ids)), np.array(whole(ids))) == 0
