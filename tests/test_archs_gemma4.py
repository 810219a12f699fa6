"""Gemma 4: `gemma4_text` and the text model of the image-text `gemma4` checkpoints, dense and with experts.

Each tiny random transformers model has every layer kind among its first layers (sliding and global layers with
heads of their own widths, layers that attend over an earlier layer's keys and values, per-layer inputs, or a mixture
of experts beside each FFN), windows shorter than the 16 test tokens, and is compared on float32 logits: the whole
sequence at once, token by token through the cache, and a 9-token prompt then single steps. The engine's other paths
(speculation by prompt lookup and by a draft model, prompt cache files) give the plain path's greedy tokens.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from command_line import one_line_error
from mlx_lm_reference import mlx_lm_convert, mlx_lm_logits, save_tokenizer
from models import check_speculation_and_prompt_cache_files
from reference import cache_errors, random_ids, reference_checkpoint, relative_error, save_reference

import minimlx
from minimlx.anatomy.ledger import ledger
from minimlx.archs import plugin_config
from minimlx.cli import main
from minimlx.core import KVCache, RotatingKVCache, SharedKVAttention, SharedKVCache
from minimlx.errors import CheckpointError

VOCAB = 96
DENSE = dict(  # per-layer inputs, the last two layers attend over layers 2 and 3's keys, with twice as wide an FFN
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 3,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    final_logit_softcapping=30.0,
    max_position_embeddings=128,
    pad_token_id=0,
)
MOE = dict(  # experts beside each FFN; global layers of one kv head whose values are their keys; no per-layer inputs
    DENSE,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
)
TOWERS = dict(  # the smallest vision and audio towers: image-text checkpoints hold them, and minimlx skips them
    vision_config=dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=64,
    ),
    audio_config=dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[4, 4],
        output_proj_dims=16,
    ),
    # the towers' tokens, beyond the test's ids: in the text, transformers reads them as padding
    image_token_id=VOCAB,
    boi_token_id=VOCAB + 1,
    eoi_token_id=VOCAB + 2,
    audio_token_id=VOCAB + 3,
    boa_token_id=VOCAB + 4,
    eoa_token_index=VOCAB + 5,
    video_token_id=VOCAB + 6,
)
IMAGE_TEXT = dict(model_class="Gemma4ForConditionalGeneration")
CONFIGS = {
    "gemma4_text": ("Gemma4TextConfig", DENSE, {}),
    "gemma4_text_moe": ("Gemma4TextConfig", MOE, {}),
    "gemma4": ("Gemma4Config", dict(TOWERS, text_config=dict(DENSE, model_type="gemma4_text")), IMAGE_TEXT),
    "gemma4_moe": ("Gemma4Config", dict(TOWERS, text_config=dict(MOE, model_type="gemma4_text")), IMAGE_TEXT),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, folder, transformers' logits, ids)."""
    config_class, config, options = CONFIGS[request.param]
    return reference_checkpoint(tmp_path_factory, request.param, config_class, {**options, **config}, VOCAB)


def test_logits_match_transformers(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert max(cache_errors(model, ids, reference)) <= 1e-4


@pytest.mark.parametrize("checkpoint", ["gemma4"], indirect=True)
def test_image_text_audio_tower_is_skipped_in_one_line(checkpoint, caplog):
    """The vision tower is read (tests/test_vision_gemma4.py); the audio tower's tensors (and its projection into
    the text model) are left out, in one line that counts them."""
    _, folder, *_ = checkpoint
    names = mx.load(str(folder / "model.safetensors"))
    audio = [k for k in names if ".audio_tower." in k or ".embed_audio." in k]
    assert audio and any(".vision_tower." in k for k in names)
    model = minimlx.load_model(folder, dtype="float32")
    assert "vision" in model
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    expected = "the text model and its vision tower are read; its other towers'"
    assert lines == [f"gemma4: {expected} {len(audio)} tensors are skipped"]


@pytest.mark.parametrize("checkpoint", ["gemma4_text"], indirect=True)
def test_shared_layers_attend_over_their_sources_keys_and_hold_none(checkpoint):
    """Layers 4 and 5 attend over the keys and values of layers 2 (sliding, so through its window) and 3 (global),
    which their caches hold; theirs count tokens only. Another source, or no per-layer inputs, changes the logits."""
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert [layer.attn.source for layer in model.layers[4:]] == [2, 3]
    assert [(layer.attn.kv_heads, layer.attn.head_dim) for layer in model.layers[:2]] == [(2, 16), (2, 32)]
    cache = model.make_cache()
    model(mx.array(ids[:, :9]), cache)
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache] * 2 + [SharedKVCache] * 2
    assert [c.offset for c in cache] == [9] * 6 and cache[4].nbytes == cache[5].nbytes == 0
    model.layers[0].attn.lends, model.layers[4].attn.source = 0, 0
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3
    model = minimlx.load_model(folder, dtype="float32")
    model.layer_inputs.embed.weight = mx.zeros_like(model.layer_inputs.embed.weight)
    assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3


@pytest.mark.parametrize("checkpoint", ["gemma4_text_moe"], indirect=True)
def test_experts_beside_the_ffn_and_values_from_keys(checkpoint):
    """The global layers have no v_proj (their values are their keys' projection); without the experts beside each
    FFN, or with the chosen weights unscaled per expert, the logits change."""
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert "v_proj" in model.layers[0].attn and "v_proj" not in model.layers[1].attn
    assert not any(isinstance(layer.attn, SharedKVAttention) for layer in model.layers)
    for change in ("moe", "expert_scale"):
        model = minimlx.load_model(folder, dtype="float32")
        for layer in model.layers:
            if change == "moe":
                layer.moe.router.experts_per_token, layer.moe.experts.down_proj.weight = (
                    1,
                    mx.zeros_like(layer.moe.experts.down_proj.weight),
                )
            else:
                layer.moe.router.expert_scale = mx.ones_like(layer.moe.router.expert_scale)
        assert relative_error(np.array(model(mx.array(ids))), reference) > 1e-3, change


@pytest.mark.parametrize("checkpoint", ["gemma4_text", "gemma4_moe"], indirect=True)
def test_speculation_and_prompt_cache_files_give_the_plain_tokens(checkpoint):
    """The engine's other paths give the plain path's tokens (`check_speculation_and_prompt_cache_files`), the shared
    layers' token counts included."""
    _, folder, _, ids = checkpoint
    check_speculation_and_prompt_cache_files(minimlx.load_model(folder, dtype="float32"), ids)


@pytest.mark.parametrize("checkpoint", ["gemma4_text"], indirect=True)
def test_quantized_and_bounded_caches_reach_the_shared_layers(checkpoint):
    """--kv-bits 8 (the global source layers' caches quantized, read as such by the layers sharing them) and a
    --max-kv-size the text fits in (their caches bounded) give plain decoding's greedy tokens."""
    from models import Ids

    from minimlx.decode import stream_generate

    _, folder, _, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    prompt = ids[0].tolist() + ids[0, :6].tolist()
    plain = [r.token for r in stream_generate(model, Ids(), prompt, max_tokens=10)]
    for setting in (dict(kv_bits=8), dict(max_kv_size=64)):
        assert [r.token for r in stream_generate(model, Ids(), prompt, max_tokens=10, **setting)] == plain, setting


@pytest.mark.parametrize("checkpoint", ["gemma4_text", "gemma4_text_moe"], indirect=True)
def test_ledger_counts_from_the_config_what_transformers_holds(checkpoint):
    """The anatomy ledger of the config alone: transformers' parameters, plus each layer's scalar (a buffer there)."""
    transformers = pytest.importorskip("transformers")
    _, folder, *_ = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    scalars = [b for key, b in model.named_buffers() if key.endswith("layer_scalar")]
    assert ledger(folder).total == sum(p.numel() for p in [*model.parameters(), *scalars])


class TwoRanks:
    """A stand-in for a group of two ranks, as a `Split` asks it (this process is rank 0)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("checkpoint", ["gemma4_text"], indirect=True)
def test_ranks_refuse_to_split_gemma4_in_one_line(checkpoint):
    """Pipeline and tensor parallelism assume blocks that read only the residual stream and their own caches: a model
    whose layers share keys and values, read inputs of their own or hold experts beside the FFN is refused."""
    from minimlx.distributed.pipeline import PipelineSplit
    from minimlx.distributed.tensor_parallel import TensorSplit
    from minimlx.errors import InvalidSettingError

    _, folder, *_ = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert not model.blocks_apart
    for split, flag in ((PipelineSplit, "--pipeline"), (TensorSplit, "--tensor-parallel")):
        with pytest.raises(InvalidSettingError, match=f"{flag} cannot split this model yet"):
            split(TwoRanks(), 2**40).shard(model, {})


def to_published_layout(folder) -> None:
    """Rewrite `config.json` with the global layers' `global_head_dim` and `num_global_key_value_heads`, as published
    Gemma 4 configs hold them (and mlx-lm reads them), in place of transformers 5's `per_layer_config`."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    setting = next(iter(config.pop("per_layer_config").values()))
    config["global_head_dim"] = setting["head_dim"]
    if "num_key_value_heads" in setting:
        config["num_global_key_value_heads"] = setting["num_key_value_heads"]
    path.write_text(json.dumps(config))


MLX_LM_VARIANTS = {
    "float32": dict(dtype="float32"),
    "4bit-g64": dict(quantize=True, q_bits=4, q_group_size=64),
    "8bit-g32": dict(quantize=True, q_bits=8, q_group_size=32),
}


@pytest.mark.parametrize(
    ("checkpoint", "variant"),
    [("gemma4_text", "float32"), ("gemma4_text", "4bit-g64"), ("gemma4_text_moe", "8bit-g32")],
    indirect=["checkpoint"],
)
def test_mlx_lm_folders_match_mlx_lm_and_transformers(checkpoint, tmp_path, variant):
    """mlx-lm's own convert of the checkpoint (in the published config layout): minimlx's logits, with the packed
    weights dequantized to float32 and kept packed, are mlx-lm's on the same folder, and transformers' where the folder
    is not quantized."""
    _, folder, reference, ids = checkpoint
    source = tmp_path / "hf"
    source.mkdir()
    for path in folder.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    to_published_layout(source)
    save_tokenizer(source)
    target = mlx_lm_convert(source, tmp_path / "mlx", **MLX_LM_VARIANTS[variant])
    expected = np.array(mlx_lm_logits(target, ids))
    if variant == "float32":
        assert relative_error(expected, reference) < 1e-4
    for dtype in ("float32", "quantized"):
        logits = minimlx.load_model(target, dtype=dtype)(mx.array(ids)).astype(mx.float32)
        assert relative_error(np.array(logits), expected) < 1e-4, dtype


SP_VOCAB = 512  # the tiny SentencePiece model's pieces, 4 more tokens in its fast tokenizer


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The dense and MoE models with a tiny SentencePiece vocabulary (llama.cpp's gemma4 converter reads a fast
    tokenizer's tokenizer.json), FFNs and experts 256 wide (so that Q4_K_M's K-quants apply to their down
    projections), converted to f32 and q8_0 by llama.cpp's converter, and the f32 file to Q4_K_M as llama-quantize
    does (gguf_quantize.py): {name: (folder, ids)}, the files beside the folders as {name}-{type}.gguf."""
    transformers = pytest.importorskip("transformers")
    from gguf_quantize import quantize
    from llamacpp import Reader, convert, llamacpp_sources, sentencepiece_model

    root, made, jobs = tmp_path_factory.mktemp("gemma4-gguf"), {}, []
    tokens = root / "tokenizer"
    transformers.GemmaTokenizer.from_pretrained(sentencepiece_model(tokens, SP_VOCAB, False).parent).save_pretrained(
        tokens
    )
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokens))
    for name, config in (("dense", DENSE), ("moe", MOE)):
        folder = root / name
        widths = dict(intermediate_size=256, moe_intermediate_size=256)
        save_reference(
            folder, "Gemma4TextConfig", **dict(config, vocab_size=vocab, vocab_size_per_layer_input=vocab, **widths)
        )
        for path in tokens.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        jobs += [(folder, kind, root / f"{name}-{kind}.gguf") for kind in ("f32", "q8_0")]
        made[name] = folder, random_ids(vocab)
    convert(jobs, llamacpp_sources())
    for name in made:
        quantize(Reader(root / f"{name}-f32.gguf"), root / f"{name}-Q4_K_M.gguf", "Q4_K_M")
    return made


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_gguf_files_from_llama_cpp_match_the_source_and_their_dequantization(gguf_files, name):
    """The f32 file gives the source folder's logits; the q8_0 file, read packed, those of its tensors as gguf-py
    (llama.cpp's reference code) dequantizes them."""
    from gguf.quants import dequantize
    from llamacpp import Reader
    from llamacpp_models import logits_of

    from minimlx.io.gguf_file import read_gguf

    folder, ids = gguf_files[name]
    source = np.array(minimlx.load_model(folder, dtype="float32")(mx.array(ids)))
    f32 = folder.with_name(f"{name}-f32.gguf")
    assert relative_error(np.array(minimlx.load_model(f32, dtype="float32")(mx.array(ids))), source) <= 1e-4
    path = folder.with_name(f"{name}-q8_0.gguf")
    tensors, metadata = read_gguf(path, mx.float32)
    assert any(key.endswith(".scales") for key in tensors)  # packed, as minimlx reads Q8_0
    reference = {t.name: mx.array(dequantize(t.data, t.tensor_type).astype(np.float32)) for t in Reader(path).tensors}
    logits, _ = logits_of(path, tensors, metadata, ids)
    assert relative_error(logits, logits_of(path, reference, metadata, ids)[0]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_q4_k_m_gguf_files_match_their_dequantization(gguf_files, name):
    """Q4_K_M (the per-layer token embedding and the down projections in K-quant blocks): the logits of the file's
    tensors as gguf-py dequantizes them, read in float32 and kept packed. Kept packed, 2-D K-quant matrices stay in
    their blocks (exact); the experts' 3-D ones become MLX affine groups (formats.md), their Q6_K ones 8-bit: about
    1e-3 off."""
    from gguf_files import load_gguf, reference_tensors
    from llamacpp_models import logits_of

    from minimlx.io.gguf_file import read_gguf

    folder, ids = gguf_files[name]
    path = folder.with_name(f"{name}-Q4_K_M.gguf")
    tensors, metadata = read_gguf(path, mx.float32)
    expected = logits_of(path, reference_tensors(path), metadata, ids)[0]
    assert relative_error(logits_of(path, tensors, metadata, ids)[0], expected) <= 1e-4
    packed, _ = load_gguf(path, "quantized")
    bound = 1e-4 if name == "dense" else 3e-3
    assert relative_error(np.array(packed(mx.array(ids)).astype(mx.float32)), expected) <= bound


@pytest.mark.slow
def test_gguf_vocabulary_gives_the_source_tokenizers_and_llama_cpps_ids(gguf_files):
    """The files' `gemma4` vocabulary (BPE over "▁"-spelled UTF-8, newline runs apart) tokenizes as the folder's
    tokenizer does, and as llama-tokenize does where it is built; decoding gives the text back."""
    from corpus import CORPUS
    from llamacpp import TOOLS, llama_tokenize

    from minimlx.io.gguf_file import GGUFFile
    from minimlx.text import Tokenizer

    folder, _ = gguf_files["dense"]
    path, texts = folder.with_name("dense-f32.gguf"), [*CORPUS, "a\n\nb\n\n\nc", "  two  spaces\tand a tab\n"]
    tokenizer = Tokenizer.from_gguf(GGUFFile(path).metadata)
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    source = Tokenizer.from_folder(folder)
    assert ids == [source.encode(text, add_special_tokens=False) for text in texts]
    assert [tokenizer.decode(i) for i in ids] == texts
    if (TOOLS / "build" / "bin" / "llama-tokenize").is_file():
        assert ids == llama_tokenize(path, texts, add_bos=False)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(DENSE, num_kv_shared_layers=6), r"num_kv_shared_layers \(6\) must be below num_hidden_layers \(6\)"),
        (dict(DENSE, num_kv_shared_layers=5), r"layer 1 \(full_attention\) shares keys and values"),
        ({"model_type": "gemma4", "vision_config": {}}, "gemma4 config needs its text_config"),
    ],
)
def test_bad_configs_are_refused_in_one_line(config, message):
    with pytest.raises(CheckpointError, match=message):
        plugin_config({"model_type": "gemma4_text", **config})


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (dict(DENSE, model_type="gemma4_text", num_kv_shared_layers=7), ["num_kv_shared_layers (7)"]),
        (dict(model_type="gemma4", vision_config={}), ["gemma4 config needs its text_config"]),
        (
            dict(
                model_type="deepseek_v32",
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=8,
                max_position_embeddings=128,
                index_topk=129,
                index_n_heads=8,
                index_head_dim=16,
            ),
            ["index_topk (129) is above the context"],
        ),
    ],
    ids=["shared-kv-past-the-stack", "image-text-without-text-config", "indexer-top-k-above-the-context"],
)
def test_cli_refuses_a_bad_2026_config_before_reading_a_tensor(tmp_path, config, words):
    """A checkpoint whose tensors file is not even a safetensors file: the config alone is refused, in one line."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not tensors")
    one_line_error(CliRunner().invoke(main, ["run", "hi", "--model", str(tmp_path)]), *words)
