"""Qwen2.5-VL with images: dynamic-resolution pixels, the windowed tower's soft tokens, multimodal RoPE positions (the
shift after the images carried by the caches through the compiled step, batching and the prompt cache), and greedy
generation, against transformers on a tiny random Qwen2_5_VLForConditionalGeneration saved with its processor (the
`qwen2_5_vl_chat` fixture, over a character tokenizer)."""

import mlx.core as mx
import numpy as np
import pytest
from reference import relative_error, require
from vision_models import (
    CHAT_IMAGE_START,
    CHAT_IMAGE_TOKEN,
    IMAGE_START,
    IMAGE_TOKEN,
    QWEN_SHAPES,
    pictures,
    qwen_inputs,
    save_qwen2_5_vl,
)

import minimlx
from minimlx.core.windowed_vision import window_order
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.decode.generate import make_cache
from minimlx.decode.images import PromptImages
from minimlx.errors import InvalidSettingError
from minimlx.vision.patches import DynamicResolutionPatches

pytestmark = pytest.mark.slow  # a transformers model is built (5 s)
TEXT_IDS = list(range(3, 40))  # characters
VISION_START, IMAGE_PAD = CHAT_IMAGE_START, CHAT_IMAGE_TOKEN


def image_prompt(text_ids: list[int], images: int, before: int = 3, start: int = VISION_START) -> list[int]:
    """`text_ids` with `images` vision start tokens, each after `before` text tokens."""
    out = []
    for i in range(images):
        out += text_ids[i * before : (i + 1) * before] + [start]
    return out + text_ids[images * before :]


@pytest.fixture(scope="module")
def qwen(qwen2_5_vl_chat):
    """(folder, torch model, transformers image processor, minimlx model and tokenizer in float32)."""
    folder, torch_model, processor = qwen2_5_vl_chat
    return folder, torch_model, processor, *minimlx.load(folder, dtype="float32")


def reference_logits(torch_model, processor, ids, images) -> np.ndarray:
    torch = require("torch")
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = torch_model(input_ids=ids, mm_token_type_ids=(ids == IMAGE_PAD).int(), **qwen_inputs(processor, images))
    return out.logits[0].numpy()


def test_pixels_and_grids_equal_the_processors_for_images_of_three_shapes(qwen):
    folder, _, processor, _, _ = qwen
    images = pictures(QWEN_SHAPES)
    ours = DynamicResolutionPatches.from_folder(folder)(images)
    assert [image.grid for image in ours] == [(1, 8, 12), (1, 18, 10), (1, 16, 10)]  # the last resized down
    theirs = processor(images=images, return_tensors="np")
    assert theirs["image_grid_thw"].tolist() == [list(image.grid) for image in ours]
    assert np.abs(np.concatenate([image.pixels for image in ours]) - theirs["pixel_values"]).max() <= 1e-5


def test_soft_tokens_equal_transformers_with_several_windows(qwen):
    torch = require("torch")
    folder, torch_model, processor, model, _ = qwen
    images = pictures(QWEN_SHAPES)
    assert len(window_order(1, 4, 6, 2)[1]) == 6  # the first picture's 4 x 6 merge blocks: 6 windows of 2 x 2
    with torch.no_grad():
        theirs = torch_model.model.get_image_features(**qwen_inputs(processor, images)).pooler_output
    theirs = torch.cat(list(theirs)).numpy()
    ours = np.array(model.encode_images(model.image_processor(images)))
    assert ours.shape == (24 + 45 + 40, 64) and relative_error(ours, theirs) <= 1e-5


def test_prompt_and_decode_positions_equal_transformers(qwen):
    """Three images of different grids: the prompt's logits (each image's tokens on their grid) and those of the tokens
    fed one by one after it (their positions shifted from their indices, read from fixed-capacity caches); without
    the shift they differ."""
    _, torch_model, processor, model, _ = qwen
    images = pictures(QWEN_SHAPES)
    prompt = image_prompt(TEXT_IDS, 3) + [50, 60, 70]
    ids, placed = PromptImages.read(model, prompt, images)
    reference = reference_logits(torch_model, processor, ids, images)
    assert placed.shift < 0  # the images take fewer positions than places
    cache = make_cache(model)  # the compiled step's fixed-capacity caches
    placed.feed(model, ids[:-4], cache)
    steps = np.stack([np.array(model(mx.array([[token]]), cache))[0, -1] for token in ids[-4:]])
    assert relative_error(steps, reference[-4:]) <= 1e-4
    unshifted = model.make_cache()
    placed.feed(model, ids[:-4], unshifted)
    for c in unshifted:
        c.shift_positions(0)
    wrong = np.array(model(mx.array([ids[-4:]]), unshifted))[0]
    assert relative_error(wrong, reference[-4:]) > 1e-2


def test_the_explainers_image_panel_grids_the_merged_tokens_and_its_walk_reads_the_picture(qwen, tmp_path):
    """`explain --image` on Qwen: the panel's grid is the merged soft tokens' over the picture's patches, and the
    walk's pass (the image in place, on its multimodal RoPE grid) gives transformers' logits."""
    from minimlx.explainer.images import ExplainedImage

    _, torch_model, processor, model, tokenizer = qwen
    picture = pictures([(60, 90)])[0]
    picture.save(tmp_path / "picture.png")
    image = ExplainedImage.read(model, tokenizer, tmp_path / "picture.png")
    ids = image.ids(tokenizer.encode(image.prompt("What is it?")), 256)
    panel = image.panel(ids)
    (rows, cols), (patch_rows, patch_cols) = panel["grid"], panel["patches"]
    assert (patch_rows, patch_cols) == (2 * rows, 2 * cols) and panel["stop"] - panel["start"] == rows * cols > 1
    assert rows != cols  # a wide picture: the grid follows its shape
    logits = minimlx.trace(model, ids, ["logits"], images=image.placed(ids))["logits"][0]
    assert relative_error(np.array(logits), reference_logits(torch_model, processor, ids, [picture])) <= 1e-4


def test_generate_with_images_gives_transformers_greedy_ids(qwen):
    _, torch_model, processor, model, tokenizer = qwen
    assert_greedy_ids_match(torch_model, processor, model, tokenizer, image_prompt(TEXT_IDS[:14], 3), IMAGE_PAD)


def assert_greedy_ids_match(torch_model, processor, model, tokenizer, prompt: list[int], image_token: int) -> None:
    """`stream_generate`'s greedy ids for `prompt` about the three pictures equal transformers' `generate`."""
    torch = require("torch")
    images = pictures(QWEN_SHAPES)
    ours = [r.token for r in minimlx.stream_generate(model, tokenizer, prompt, images=images, max_tokens=10)]
    ids = torch.tensor([model.config.expand_images(prompt, model.image_processor(images))])
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=ids,
            mm_token_type_ids=(ids == image_token).int(),
            max_new_tokens=10,
            do_sample=False,
            **qwen_inputs(processor, images),
        )
    assert len(ours) >= 2 and ours == out[0, ids.shape[1] :].tolist()[: len(ours)]


def test_rows_with_and_without_images_batch_and_reuse_the_prompt_cache(qwen, tmp_path):
    """An image prompt and a text prompt decode in one batch, each as it does alone; the image conversation's next
    turn reuses its cache (the shift after its image with it), in memory and from a prompt cache file after a restart,
    and answers as a cold read does."""
    _, _, _, model, tokenizer = qwen
    picture = pictures(QWEN_SHAPES)[:1]
    ids, placed = PromptImages.read(model, image_prompt(TEXT_IDS[:8], 1), picture)
    text = TEXT_IDS[10:30]
    no_end = {"stop_ids": frozenset(), "settings": SamplingSettings(max_tokens=8)}  # every answer runs to 8 tokens

    def run(engine, requests):
        generations = [engine.submit(r) for r in requests]
        while any(g.running for g in generations):
            engine.step()
        return [(list(g.tokens), g.cached_tokens) for g in generations]

    alone = [
        run(Engine(model, tokenizer), [r])[0][0]
        for r in (Request(ids, images=placed, **no_end), Request(text, **no_end))
    ]
    saving = dict(prompt_cache_size=4, prompt_cache_dir=str(tmp_path))
    engine = Engine(model, tokenizer, **saving)
    assert [t for t, _ in run(engine, [Request(ids, images=placed, **no_end), Request(text, **no_end)])] == alone
    assert max(engine.runner.batch_sizes) == 2
    follow = ids + alone[0] + TEXT_IDS[30:34]
    again = Request(follow, images=PromptImages.read(model, follow, picture)[1], **no_end)
    cold = run(Engine(model, tokenizer), [again])[0][0]
    for warm in (engine, Engine(model, tokenizer, **saving)):  # in memory; from the file, restarted
        tokens, cached = run(warm, [again])[0]
        assert cached >= len(ids) and tokens == cold


def test_run_with_images_answers_as_generate_does(qwen, tmp_path):
    from click.testing import CliRunner

    from minimlx.cli import main

    folder, *_, model, tokenizer = qwen
    paths = []
    for i, picture in enumerate(pictures(QWEN_SHAPES)):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        picture.save(tmp_path / f"{i}.png")
    prompt = "<start_of_image>".join(["Look: ", ", then ", " and ", ". Which?"])
    options = ["--model", str(folder), "--dtype", "float32", "--no-chat-template", "--max-tokens", "6", "--temp", "0"]
    result = CliRunner().invoke(main, ["run", prompt, *options, *paths])
    assert result.exit_code == 0, result.output
    images = [tmp_path / f"{i}.png" for i in range(3)]
    answer = minimlx.generate(model, tokenizer, prompt, chat_template=False, images=images, max_tokens=6)
    assert answer and result.stdout.strip() == answer.strip()


def test_qwen2_vl_soft_tokens_and_greedy_ids_equal_transformers(tmp_path):
    """Qwen2-VL: the same text side and processor, a tower without windows."""
    torch = require("torch")
    torch_model, processor = save_qwen2_5_vl(tmp_path, family="Qwen2VL")
    model, tokenizer = minimlx.load(tmp_path, dtype="float32")
    assert model.config.vision.window is None
    images = pictures(QWEN_SHAPES)
    with torch.no_grad():
        theirs = torch.cat(list(torch_model.model.get_image_features(**qwen_inputs(processor, images)).pooler_output))
    assert relative_error(np.array(model.encode_images(model.image_processor(images))), theirs.numpy()) <= 1e-5
    prompt = image_prompt(TEXT_IDS[:14], 3, start=IMAGE_START)
    assert_greedy_ids_match(torch_model, processor, model, tokenizer, prompt, IMAGE_TOKEN)
    assert_written_back_as_saved(model, tmp_path)


def assert_written_back_as_saved(model, folder) -> None:
    """`export_weights` (what `convert` writes) gives the saved checkpoint's names and shapes (the patch kernel 5D)."""
    from mlx.utils import tree_flatten

    written = model.config.export_weights(dict(tree_flatten(model.parameters())))
    saved = mx.load(str(folder / "model.safetensors"))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in saved.items()}


def test_the_published_layout_is_written_back(qwen):
    folder, *_, model, _ = qwen
    assert_written_back_as_saved(model, folder)


def test_an_image_read_again_is_not_encoded_again_and_answers_as_a_cold_read(qwen, monkeypatch):
    """With no prompt cache the next turn is read again from its start, its image's soft tokens kept from the turn
    before (the encoder runs once, for the first turn); its ids equal a cold engine's, whose encoder runs."""
    _, _, _, model, tokenizer = qwen
    calls = []
    encode = type(model).encode_images
    monkeypatch.setattr(
        type(model), "encode_images", lambda self, images: calls.append(len(images)) or encode(self, images)
    )
    picture = pictures(QWEN_SHAPES)[:1]
    settings = SamplingSettings(max_tokens=4)
    first = image_prompt(TEXT_IDS[:8], 1)
    follow = first + TEXT_IDS[20:26]

    def answer(engine, ids):
        ids, placed = PromptImages.read(model, ids, picture)
        generation = engine.submit(Request(ids, settings, stop_ids=frozenset(), images=placed))
        while generation.running:
            engine.step()
        return list(generation.tokens)

    engine = Engine(model, tokenizer)
    answer(engine, first)
    assert calls == [1]
    warm = answer(engine, follow)
    assert calls == [1]  # not encoded again
    assert warm == answer(Engine(model, tokenizer), follow) and calls == [1, 1]


def test_batch_generate_takes_images_per_prompt(qwen):
    """Two image prompts (different pictures) and a text prompt decode together, each as `generate` answers it alone."""
    _, _, _, model, tokenizer = qwen
    two = pictures(QWEN_SHAPES)[:2]
    prompts = [image_prompt(TEXT_IDS[:8], 1), image_prompt(TEXT_IDS[5:12], 1), TEXT_IDS[10:20]]
    images = [[two[0]], [two[1]], None]
    together = minimlx.batch_generate(model, tokenizer, prompts, images=images, max_tokens=5, temperature=0)
    alone = [minimlx.generate(model, tokenizer, p, images=i, max_tokens=5) for p, i in zip(prompts, images)]
    assert together == alone and len(set(together)) == 3
    with pytest.raises(InvalidSettingError, match="one per prompt"):
        minimlx.batch_generate(model, tokenizer, prompts, images=images[:2])


def test_chat_sends_an_image_with_the_next_message(qwen, tmp_path):
    """`/image PATH` puts the picture before the next message's text; the turn after it prefills only its own tokens
    and answers as a cold read of the whole conversation does."""
    from click.testing import CliRunner

    from minimlx.cli import main
    from minimlx.decode import Conversation

    folder, *_, model, tokenizer = qwen
    picture = pictures(QWEN_SHAPES)[2]
    picture.save(tmp_path / "p.png")
    options = ["--model", str(folder), "--dtype", "float32", "--max-tokens", "5", "--temp", "0"]
    lines = f"/image {tmp_path / 'absent.png'}\n/image {tmp_path / 'p.png'}\nDescribe it.\nAnd the colours?\n"
    result = CliRunner().invoke(main, ["chat", *options], input=lines)
    assert result.exit_code == 0, result.output
    assert "no such image file" in result.stderr
    conversation = Conversation(model, tokenizer)
    first = "".join(r.text for r in conversation.say("Describe it.", images=[tmp_path / "p.png"], max_tokens=5))
    responses = list(conversation.say("And the colours?", max_tokens=5))
    second = "".join(r.text for r in responses)
    assert responses[-1].prompt_tokens < 40  # only the new turn was fed: the image alone takes 8 x 5 places
    start = tokenizer.decode([model.config.image_start_token])
    messages = [
        {"role": "user", "content": start + "Describe it."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And the colours?"},
    ]
    cold = minimlx.generate(
        model, tokenizer, tokenizer.apply_chat_template(messages), chat_template=False, images=[picture], max_tokens=5
    )
    assert second == cold and result.stdout == f"{first}\n{second}\n"


def mlx_vlm_name(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """mlx-vlm's name and layout of a tensor of the published layout (its qwen2_5_vl `sanitize`): the tower under
    `vision_tower.`, the text model under `language_model.`, the patch kernel channels-last (dims, frames, p, p,
    channels)."""
    if name == "visual.patch_embed.proj.weight":
        w = w.transpose(0, 2, 3, 4, 1)
    if name.startswith("visual."):
        return "vision_tower." + name.removeprefix("visual."), w
    return "language_model." + name, w


def test_an_mlx_vlm_folder_loads_into_the_same_model(qwen, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, *_, model, _ = qwen
    saved = load_file(str(folder / "model.safetensors"))
    renamed = dict(mlx_vlm_name(name, w) for name, w in saved.items())
    assert renamed["vision_tower.patch_embed.proj.weight"].shape == (32, 2, 7, 7, 3)
    save_file({name: np.ascontiguousarray(w) for name, w in renamed.items()}, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    theirs = minimlx.load_model(tmp_path, dtype="float32")
    inputs = model.image_processor(pictures(QWEN_SHAPES))
    assert np.array_equal(np.array(theirs.encode_images(inputs)), np.array(model.encode_images(inputs)))
    ids = mx.array([[3, 4, 5]])
    assert np.array_equal(np.array(theirs(ids)), np.array(model(ids)))
