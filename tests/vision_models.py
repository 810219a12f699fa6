"""A tiny random Gemma 3 image-text model saved by transformers with its image processor, and test pictures."""

from pathlib import Path

import numpy as np
from mlx_lm_reference import VOCAB, save_tokenizer
from reference import require, save_reference

IMAGE_START, IMAGE_END, IMAGE_TOKEN = 93, 94, 95
TOKENS_PER_IMAGE = 16
IMAGE_SIZE = 56

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    sliding_window=8,  # shorter than an image's 16 soft tokens: the window cuts into its both-ways attention
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,  # the word tokenizer's end (w1)
)

GEMMA3_IMAGE_TEXT = dict(
    text_config=TEXT,
    vision_config=dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=7,  # 8 x 8 patches, pooled 2 x 2 into 16 soft tokens
    ),
    mm_tokens_per_image=TOKENS_PER_IMAGE,
    boi_token_index=IMAGE_START,
    eoi_token_index=IMAGE_END,
    image_token_index=IMAGE_TOKEN,
)

SHAPES = [(37, 91), (120, 64), (56, 56)]  # (height, width): wide, tall, the model's own size


def pictures(shapes=SHAPES, seed: int = 0) -> list:
    """Pillow RGB images of `shapes`, smooth gradients plus noise (so resampling has something to average)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for height, width in shapes:
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
        noisy = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(noisy))
    return images


def save_gemma3_image_text(folder: Path, seed: int = 0, outer: dict | None = None, **text):
    """The tiny random Gemma3ForConditionalGeneration (its text config updated with `text`, its own with `outer`)
    saved to `folder` with Gemma 3's image processor and a word tokenizer; returns the torch model and the
    transformers image processor."""
    transformers = require("transformers")
    config = {**GEMMA3_IMAGE_TEXT, **(outer or {}), "text_config": {**TEXT, **text}}
    model = save_reference(folder, "Gemma3Config", seed, model_class="Gemma3ForConditionalGeneration", **config)
    processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(folder)
    save_tokenizer(folder)
    return model, processor


# A tokenizer of printable ASCII characters and newline (one token each), then its special tokens: any text a
# client sends back, tool calls among them, is read back as the same ids.
CHARACTERS = [10] + list(range(32, 127))
EOS, CHAT_IMAGE_START, CHAT_IMAGE_END, CHAT_IMAGE_TOKEN = range(len(CHARACTERS) + 1, len(CHARACTERS) + 5)
SPECIALS = ["<eos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}assistant:"


def save_character_tokenizer(folder: Path, specials: list[str] = SPECIALS, eos: str = "<eos>") -> None:
    """Byte-level (as GPT-2's) over `CHARACTERS` alone, `<unk>` next, then `specials`, and `CHAT_TEMPLATE`."""
    tokenizers, transformers = require("tokenizers"), require("transformers")
    alphabet = {b: chr(b) if 33 <= b < 127 else chr(256 + b) for b in CHARACTERS}  # GPT-2's bytes as characters
    vocab = {alphabet[b]: i for i, b in enumerate(CHARACTERS)} | {"<unk>": len(CHARACTERS)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token=eos)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def save_gemma3_chat(folder: Path, seed: int = 0):
    """`save_gemma3_image_text`'s model over the character tokenizer, with its chat template (what a server serves);
    returns the torch model and the transformers image processor."""
    outer = dict(boi_token_index=CHAT_IMAGE_START, eoi_token_index=CHAT_IMAGE_END, image_token_index=CHAT_IMAGE_TOKEN)
    outer |= dict(tie_word_embeddings=False)  # a head of its own: tied, each token's logits would favour itself
    text = dict(vocab_size=EOS + len(SPECIALS), eos_token_id=EOS, bos_token_id=EOS, max_position_embeddings=1024)
    text |= dict(tie_word_embeddings=False, sliding_window=48)  # local layers see the image from a short question
    model, processor = save_gemma3_image_text(folder, seed, outer, **text)
    with_character_tokenizer(folder)
    return model, processor


GEMMA3_PROCESSOR_TOKENS = {"boi_token": SPECIALS[1], "eoi_token": SPECIALS[2], "image_token": SPECIALS[3]}
# Gemma 3's chat template's way with a message's parts: an image part is its start token, text parts as they are
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ '<start_of_image>' if p['type'] == 'image' else p['text'] }}{% endfor %}"
    "{% endif %}{{ '\\n' }}{% endfor %}assistant:"
)


def gemma3_processor(folder: Path, image_processor):
    """transformers' Gemma3Processor over `save_gemma3_chat`'s tokenizer and image processor (what writes each image
    of a text prompt out, blank lines around it, before tokenizing)."""
    transformers = require("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=GEMMA3_PROCESSOR_TOKENS)
    return transformers.Gemma3Processor(image_processor, tokenizer, image_seq_length=TOKENS_PER_IMAGE)


def with_character_tokenizer(folder: Path, specials: list[str] = SPECIALS) -> None:
    """The word tokenizer a save wrote into `folder` replaced by the character tokenizer (with `specials`) and its
    chat template."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    save_character_tokenizer(folder, specials)


def check_run_with_images(folder: Path, words: list[int], images: list, expected: str, tmp_path: Path) -> None:
    """`minimlx run --image` with `images` saved as PNG files, on the word tokenizer's prompt of `words` (greedy, 8
    tokens, no chat template), prints `expected`."""
    from click.testing import CliRunner

    from minimlx.cli import main

    paths = []
    for i, picture in enumerate(images):
        picture.save(tmp_path / f"{i}.png")
        paths += ["--image", str(tmp_path / f"{i}.png")]
    prompt = " ".join(f"w{i}" for i in words)
    options = ["--model", str(folder), "--dtype", "float32", "--no-chat-template", "--max-tokens", "8", "--temp", "0"]
    result = CliRunner().invoke(main, ["run", prompt, *options, *paths])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == expected.strip()


def image_prompt(text_ids: list[int], images: int, before: int = 3) -> list[int]:
    """`text_ids` with `images` image start tokens, each after `before` text tokens."""
    out = []
    for i in range(images):
        out += text_ids[i * before : (i + 1) * before] + [IMAGE_START]
    return out + text_ids[images * before :]


# Qwen2.5-VL: a tower of 7-pixel patches merged 2 x 2 (a soft token per 14 x 14 pixels), windows of 2 x 2 merge blocks
# in its first block and the whole picture in its second, pictures resized to at most 48 soft tokens
VISION_START, VISION_END, IMAGE_PAD = IMAGE_START, IMAGE_END, IMAGE_TOKEN
QWEN_SHAPES = [(56, 84), (120, 64), (300, 200)]  # 4 x 6 merge blocks (6 windows); 9 x 5; resized to 8 x 5

QWEN_TOWER = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=7,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
QWEN2_5_VL = dict(
    text_config=dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=1,
    ),
    vision_config=dict(QWEN_TOWER, window_size=28, fullatt_block_indexes=[1]),
    image_token_id=IMAGE_PAD,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    video_token_id=96,
    tie_word_embeddings=False,
)


# Qwen2-VL's tower: LayerNorm and QuickGELU-MLP blocks over the whole picture, its width `embed_dim`
QWEN2_VL_TOWER = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, patch_size=7)


def save_qwen2_5_vl(folder: Path, seed: int = 0, outer: dict | None = None, family: str = "Qwen2_5_VL", **text):
    """The tiny random Qwen2_5_VLForConditionalGeneration (with `family` "Qwen2VL", Qwen2VLForConditionalGeneration)
    saved to `folder` with Qwen2-VL's image processor (Pillow's) and a word tokenizer; returns the torch model and the
    transformers image processor."""
    config = {**QWEN2_5_VL, **(outer or {}), "text_config": {**QWEN2_5_VL["text_config"], **text}}
    if family == "Qwen2VL" and "vision_config" not in (outer or {}):
        config["vision_config"] = QWEN2_VL_TOWER
    return save_qwen_image_text(folder, family, config, seed)


def save_qwen_image_text(folder: Path, family: str, config: dict, seed: int = 0, **processor):
    """The tiny random `family`ForConditionalGeneration of `config` saved to `folder` (its norms about 1, not 0: the
    answers of a random model then vary with the input) with Qwen2-VL's image processor (Pillow's, as every Qwen
    family's; `processor` its further settings) and a word tokenizer; returns the torch model and the processor."""
    transformers = require("transformers")
    model = save_reference(folder, family + "Config", seed, model_class=f"{family}ForConditionalGeneration", **config)
    with require("torch").no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim == 1 and ("norm" in name or "ln_q" in name):
                weight.add_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    settings = dict(patch_size=7, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28, max_pixels=14 * 14 * 48)
    image_processor = transformers.Qwen2VLImageProcessorPil(**settings, **processor)
    image_processor.save_pretrained(folder)
    save_tokenizer(folder)
    return model, image_processor


# Qwen3-VL: Qwen3's text model under an interleaved multimodal RoPE, a tower of LayerNorm blocks with learned
# positions (a 4 x 4 table resampled to each grid) and two DeepStack levels (added after text layers 0 and 1);
# Qwen3.5: its hybrid text model (a DeltaNet layer, then a gated attention one over half of each head) and the same
# tower without DeepStack. The processor normalises to [-1, 1] as theirs do.
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 100.0, "mrope_interleaved": True}
QWEN3_VL_TEXT = dict(QWEN2_5_VL["text_config"], head_dim=16, rope_parameters={**QWEN3_ROPE, "mrope_section": [2, 3, 3]})
QWEN3_TOWER = dict(QWEN_TOWER, num_position_embeddings=16)
QWEN3_5_TEXT = dict(
    QWEN3_VL_TEXT,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters={**QWEN3_ROPE, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5},
)
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
QWEN3_FAMILIES = {
    "Qwen3VL": (QWEN3_VL_TEXT, {"deepstack_visual_indexes": [0, 1]}),
    "Qwen3VLMoe": ({**QWEN3_VL_TEXT, **QWEN3_MOE}, {"deepstack_visual_indexes": [1]}),
    "Qwen3_5": (QWEN3_5_TEXT, {}),
    "Qwen3_5Moe": ({**QWEN3_5_TEXT, **QWEN3_MOE, "shared_expert_intermediate_size": 24}, {}),
}


def save_qwen3_image_text(folder: Path, family: str = "Qwen3VL", seed: int = 0, chat: bool = False):
    """The tiny random Qwen3-VL or Qwen3.5 (`family`: a key of `QWEN3_FAMILIES`) saved to `folder` with its image
    processor, over the word tokenizer (with `chat`, the character tokenizer and its chat template); returns the
    torch model and the transformers image processor."""
    text, tower = QWEN3_FAMILIES[family]
    tokens = dict(image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    if chat:
        tokens = dict(image_token_id=CHAT_IMAGE_TOKEN, vision_start_token_id=CHAT_IMAGE_START)
        tokens |= dict(vision_end_token_id=CHAT_IMAGE_END)
        text = dict(text, vocab_size=EOS + len(SPECIALS), eos_token_id=EOS, bos_token_id=EOS)
    config = dict(text_config=text, vision_config={**QWEN3_TOWER, **tower}, video_token_id=0, **tokens)
    model, processor = save_qwen_image_text(folder, family, config, seed, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    if chat:
        with_character_tokenizer(folder)
    return model, processor


def save_qwen2_5_vl_chat(folder: Path, seed: int = 0):
    """`save_qwen2_5_vl`'s model over the character tokenizer and its chat template (its image start, end and pad
    tokens the tokenizer's special ones)."""
    outer = dict(vision_start_token_id=CHAT_IMAGE_START, vision_end_token_id=CHAT_IMAGE_END)
    outer |= dict(image_token_id=CHAT_IMAGE_TOKEN, video_token_id=0)
    text = dict(vocab_size=EOS + len(SPECIALS), eos_token_id=EOS, bos_token_id=EOS)
    model, processor = save_qwen2_5_vl(folder, seed, outer, **text)
    with_character_tokenizer(folder)
    return model, processor


def qwen_inputs(processor, images) -> dict:
    """transformers' image inputs of `images`: pixel_values and image_grid_thw, as torch tensors."""
    torch = require("torch")
    out = processor(images=images, return_tensors="np")
    return {"pixel_values": torch.tensor(out["pixel_values"]), "image_grid_thw": torch.tensor(out["image_grid_thw"])}


# Mistral 3: the Pixtral encoder over 4-pixel patches, 2 x 2 of them merged into each soft token, pictures fitted
# into 48 pixels; the word tokenizer's w10, w12 and w13 stand for [IMG], [IMG_BREAK] and [IMG_END] (tekken's ids).
PIXTRAL_IMAGE, PIXTRAL_BREAK, PIXTRAL_END = 10, 12, 13
PIXTRAL_PATCH, PIXTRAL_MERGE, PIXTRAL_LONGEST_EDGE = 4, 2, 48

MISTRAL3_IMAGE_TEXT = dict(
    text_config=dict(
        model_type="mistral",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,  # the word tokenizer's end (w2, not w1: the image tokens' words start with w1)
    ),
    vision_config=dict(
        model_type="pixtral",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=PIXTRAL_LONGEST_EDGE,
        patch_size=PIXTRAL_PATCH,
    ),
    image_token_index=PIXTRAL_IMAGE,
    spatial_merge_size=PIXTRAL_MERGE,
    tie_word_embeddings=False,
)


def save_mistral3_image_text(folder: Path, seed: int = 0, outer: dict | None = None, **text):
    """The tiny random Mistral3ForConditionalGeneration (its text config updated with `text`, its own with `outer`)
    saved to `folder` with Pixtral's image processor (the Pillow one) and a word tokenizer; returns the torch model and
    the transformers image processor."""
    transformers = require("transformers")
    config = {**MISTRAL3_IMAGE_TEXT, **(outer or {}), "text_config": {**MISTRAL3_IMAGE_TEXT["text_config"], **text}}
    model = save_reference(folder, "Mistral3Config", seed, model_class="Mistral3ForConditionalGeneration", **config)
    size = {"height": PIXTRAL_PATCH, "width": PIXTRAL_PATCH}
    processor = transformers.PixtralImageProcessorPil(patch_size=size, size={"longest_edge": PIXTRAL_LONGEST_EDGE})
    processor.save_pretrained(folder)
    save_tokenizer(folder, eos="w2")
    return model, processor


def pixtral_inputs(processor, images) -> dict:
    """The image processor's output as Mistral 3's processor (PixtralProcessor) asks for it: squares of the patch
    times the spatial merge."""
    side = PIXTRAL_PATCH * PIXTRAL_MERGE
    return processor(images=images, patch_size={"height": side, "width": side}, return_tensors="np")


def pixtral_layout(height: int, width: int, tokens=(PIXTRAL_IMAGE, PIXTRAL_BREAK, PIXTRAL_END)) -> list[int]:
    """An image's places as PixtralProcessor.replace_image_token writes them (the processor itself needs
    torchvision): [IMG] per merged square, [IMG_BREAK] after each row, the last replaced by [IMG_END] (`tokens`:
    their ids)."""
    image, row_break, end = tokens
    side = PIXTRAL_PATCH * PIXTRAL_MERGE
    places = ([image] * (width // side) + [row_break]) * (height // side)
    return places[:-1] + [end]


# Mistral 3 over the character tokenizer: Pixtral's tokens its special ones, at other ids than tekken's; the config
# names [IMG] alone, as Hugging Face's do (the model reads [IMG_BREAK] and [IMG_END] from the tokenizer)
MISTRAL3_SPECIALS = ["<eos>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_CHAT_TOKENS = (CHAT_IMAGE_START, CHAT_IMAGE_END, CHAT_IMAGE_TOKEN)  # [IMG], [IMG_BREAK], [IMG_END]


def save_mistral3_chat(folder: Path, seed: int = 0):
    """`save_mistral3_image_text`'s model over the character tokenizer with `MISTRAL3_SPECIALS` and its chat
    template; returns the torch model and the transformers image processor."""
    text = dict(
        vocab_size=EOS + len(MISTRAL3_SPECIALS), eos_token_id=EOS, bos_token_id=EOS, max_position_embeddings=1024
    )
    model, processor = save_mistral3_image_text(folder, seed, dict(image_token_index=MISTRAL3_CHAT_TOKENS[0]), **text)
    with_character_tokenizer(folder, MISTRAL3_SPECIALS)
    return model, processor


# Gemma 4: a tower of 4-pixel patches pooled 2 x 2 into each soft token, pictures resized to at most 70 soft tokens
# (280 patches) at their own aspect; in the prompt `<|image|>` once per image, written out as `<|image>`, a soft token
# per place, `<image|>`. Its image tokens see each other both ways in the sliding layers, whose windows (8) are
# shorter than an image's tokens.
GEMMA4_IMAGE, GEMMA4_START, GEMMA4_END = IMAGE_TOKEN, IMAGE_START, IMAGE_END
GEMMA4_PATCH, GEMMA4_POOLING, GEMMA4_SOFT_TOKENS = 4, 2, 70

GEMMA4_IMAGE_TEXT = dict(
    text_config=dict(
        model_type="gemma4_text",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=1,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0,
        max_position_embeddings=1024,
        use_bidirectional_attention="vision",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    vision_config=dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=GEMMA4_PATCH,
        pooling_kernel_size=GEMMA4_POOLING,
        position_embedding_size=160,
        standardize=True,
        use_clipped_linears=True,
    ),
    audio_config=None,
    image_token_id=GEMMA4_IMAGE,
    boi_token_id=GEMMA4_START,
    eoi_token_id=GEMMA4_END,
    # the audio and video tokens, beyond any test's ids (transformers reads their places as padding)
    audio_token_id=1000,
    boa_token_id=1001,
    eoa_token_index=1002,
    video_token_id=1003,
    tie_word_embeddings=True,
)


def save_gemma4_image_text(folder: Path, seed: int = 0, outer: dict | None = None, **text):
    """The tiny random Gemma4ForConditionalGeneration (its text config updated with `text`, its own with `outer`)
    saved to `folder` with Gemma 4's image processor (the Pillow one) and a word tokenizer; returns the torch model
    and the transformers image processor."""
    transformers = require("transformers")
    config = {**GEMMA4_IMAGE_TEXT, **(outer or {}), "text_config": {**GEMMA4_IMAGE_TEXT["text_config"], **text}}
    torch = require("torch")
    model = save_reference(
        folder, "Gemma4Config", seed, ("std_bias", "std_scale"), model_class="Gemma4ForConditionalGeneration", **config
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the clipped linears' bounds where they clamp some of the values, not at infinity
        for name, bound in model.named_buffers():
            if name.endswith(("_min", "_max")):
                width = 0.5 + 2 * torch.rand((), generator=generator)
                bound.fill_(-width if name.endswith("_min") else width)
    model.save_pretrained(folder, safe_serialization=True)
    processor = transformers.Gemma4ImageProcessorPil(
        patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOLING, max_soft_tokens=GEMMA4_SOFT_TOKENS
    )
    processor.save_pretrained(folder)
    save_tokenizer(folder, eos="w2")
    return model, processor


def gemma4_inputs(processor, images) -> dict:
    """transformers' image inputs of `images`: pixel_values, image_position_ids (torch) and each image's soft
    tokens."""
    torch = require("torch")
    out = processor(images=images, return_tensors="np")
    return {
        "pixel_values": torch.tensor(out["pixel_values"]),
        "image_position_ids": torch.tensor(out["image_position_ids"]),
        "soft_tokens": [int(n) for n in out["num_soft_tokens_per_image"]],
    }


def save_gemma4_chat(folder: Path, seed: int = 0):
    """`save_gemma4_image_text`'s model over the character tokenizer and its chat template (its image begin, end and
    soft tokens the tokenizer's special ones; the prompt writes the soft token once per image)."""
    outer = dict(boi_token_id=CHAT_IMAGE_START, eoi_token_id=CHAT_IMAGE_END, image_token_id=CHAT_IMAGE_TOKEN)
    outer |= dict(tie_word_embeddings=False)  # a head of its own: tied, each token's logits would favour itself
    vocab = EOS + len(SPECIALS)
    text = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, eos_token_id=EOS, bos_token_id=EOS)
    text |= dict(tie_word_embeddings=False, sliding_window=48)  # sliding layers see the image from a short question
    model, processor = save_gemma4_image_text(folder, seed, outer, **text)
    with_character_tokenizer(folder)
    return model, processor


# Idefics3 / SmolVLM: the character tokenizer with the processor's tokens; tiles of 28 pixels, 4 x 4 patches of 7
# shuffled 2 x 2 into 4 soft tokens each; pictures resized to a longest edge of two tiles.
IDEFICS3_SPECIALS = ["<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)
]
IDEFICS3_IMAGE_TOKEN = len(CHARACTERS) + 1 + IDEFICS3_SPECIALS.index("<image>")
IDEFICS3_TILE, IDEFICS3_TOKENS_PER_TILE = 28, 4
IDEFICS3_SHAPES = [
    (37, 91),
    (120, 64),
    (61, 50),
]  # (height, width): wide (1 x 2 tiles), tall (2 x 2), near square (2 x 2)


def save_idefics3(folder: Path, model_class: str = "Idefics3", seed: int = 0, **processor):
    """A tiny random `{model_class}ForConditionalGeneration` (Idefics3 or SmolVLM: a LLaMA text model) saved to
    `folder` with its processor (`Idefics3Processor` over the PIL image processor, its settings updated with
    `processor`) and the character tokenizer; returns the torch model and the transformers processor."""
    transformers = require("transformers")
    eos = len(CHARACTERS) + 1  # <end_of_utterance>
    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IDEFICS3_TILE,
        patch_size=7,
    )
    config = dict(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IDEFICS3_IMAGE_TOKEN)
    model = save_reference(
        folder, f"{model_class}Config", seed, model_class=f"{model_class}ForConditionalGeneration", **config
    )
    save_character_tokenizer(folder, IDEFICS3_SPECIALS, eos="<end_of_utterance>")
    settings = dict(size={"longest_edge": 2 * IDEFICS3_TILE}, max_image_size={"longest_edge": IDEFICS3_TILE})
    images = transformers.Idefics3ImageProcessorPil(**{**settings, **processor})
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.Idefics3Processor(images, tokenizer, image_seq_len=IDEFICS3_TOKENS_PER_TILE)
    images.save_pretrained(folder)
    return model, reference
