"""Hybrid families (recurrent token-mixers beside attention) against transformers: qwen3_5_text, qwen3_5_moe_text,
qwen3_next, the image-text qwen3_5, lfm2 and granitemoehybrid (dense and with experts).

Each tiny random transformers model (a recurrent layer and an attention layer among the first layers) is saved,
loaded by minimlx and compared on float32 logits: the whole sequence at once (longer than the convolution's window
and than one chunk of the delta rule), a prompt then one token at a time through the cache, and in the
transformers 4 config layout.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from hybrid_model import FAMILIES as CONFIGS
from hybrid_model import FAMILY_VOCAB as VOCAB
from hybrid_model import GRANITE, QWEN3_5
from reference import random_ids, reference_logits, relative_error, save_reference, to_v4_layout

import minimlx
from minimlx.core import (
    RecurrentCache,
    decayed_scan_chunked,
    decayed_scan_recurrent,
    gated_delta_chunked,
    gated_delta_recurrent,
)
from minimlx.errors import CheckpointError

TOKENS = 80  # over one 64-token chunk of the delta rule
PROMPT = 70


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    config_class, config = CONFIGS[request.param]
    torch_model = save_reference(folder, config_class, **config)
    ids = random_ids(VOCAB, tokens=TOKENS)
    return folder, reference_logits(torch_model, ids), ids


def test_whole_sequence_matches_transformers(checkpoint):
    folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def test_prompt_then_steps_through_the_cache_match_transformers(checkpoint):
    folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    assert {type(c).__name__ for c in cache} == {"RecurrentCache", "KVCache"}
    steps = [model(mx.array(ids[:, :PROMPT]), cache)]
    steps += [model(mx.array(ids[:, t : t + 1]), cache) for t in range(PROMPT, TOKENS)]
    assert relative_error(np.array(mx.concatenate(steps, axis=1)), reference) <= 1e-4


def test_token_by_token_matches_transformers(checkpoint):
    folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    steps = [model(mx.array(ids[:, t : t + 1]), cache) for t in range(24)]
    assert relative_error(np.array(mx.concatenate(steps, axis=1)), reference[:, :24]) <= 1e-4


def test_transformers_4_layout(checkpoint, tmp_path):
    folder, reference, ids = checkpoint
    shutil.copytree(folder, tmp_path / "v4")
    to_v4_layout(tmp_path / "v4")
    model = minimlx.load_model(tmp_path / "v4", dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def delta_inputs(tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((2, 3, tokens, 8)).astype(np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((2, 3, tokens, 5)).astype(np.float32)
    g = -np.abs(rng.standard_normal((2, 3, tokens))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((2, 3, tokens))))).astype(np.float32)
    state = rng.standard_normal((2, 3, 8, 5)).astype(np.float32)
    return [mx.array(a) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_and_recurrent_delta_rule_agree(chunk):
    """From a nonzero state, over a length that leaves a partial last chunk: the same outputs and final state."""
    inputs = delta_inputs(37)
    out, state = gated_delta_recurrent(*inputs)
    chunked_out, chunked_state = gated_delta_chunked(*inputs, chunk=chunk)
    assert relative_error(np.array(chunked_out), np.array(out)) <= 1e-5
    assert relative_error(np.array(chunked_state), np.array(state)) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_and_recurrent_state_space_scan_agree(chunk):
    q, k, v, g, _, state = delta_inputs(37, seed=1)
    out, final = decayed_scan_recurrent(q, k, v, g, state)
    chunked_out, chunked_final = decayed_scan_chunked(q, k, v, g, state, chunk=chunk)
    assert relative_error(np.array(chunked_out), np.array(out)) <= 1e-5
    assert relative_error(np.array(chunked_final), np.array(final)) <= 1e-5


def test_left_padding_leaves_the_state_unchanged(checkpoint):
    """A row left-padded inside a batched pass ends with the state and logits it has alone."""
    folder, _, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    alone = model.make_cache()
    short = ids[1:, :20]
    expected = np.array(model(mx.array(short), alone)[:, -1])
    caches = [model.make_cache(), model.make_cache()]
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]
    for layer in batch:
        layer.padding = [0, 10]
    rows = np.concatenate([ids[:1, :30], np.concatenate([np.zeros((1, 10), int), short], axis=1)])
    logits = np.array(model(mx.array(rows), batch)[:, -1])
    assert relative_error(logits[1:], expected) <= 1e-4
    after = [c.select([1]) for c in batch]
    for got, want in zip(after, alone):
        if isinstance(want, RecurrentCache):
            assert got.lengths == want.lengths == [20]
            for got_state, want_state in zip(got.state, want.state, strict=True):
                assert relative_error(np.array(got_state), np.array(want_state)) <= 1e-4


def test_recurrent_cache_refuses_to_forget_tokens(checkpoint):
    folder, _, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    model(mx.array(ids[:, :10]), cache)
    recurrent = next(c for c in cache if isinstance(c, RecurrentCache))
    assert recurrent.keeps(10) and not recurrent.keeps(9)
    snapshot = recurrent.prefix(10)
    with pytest.raises(ValueError, match="whole prefix"):
        recurrent.trim(1)
    model(mx.array(ids[:, 10:12]), cache)
    assert snapshot.offset == 10 and recurrent.offset == 12


def test_snapshot_restores_a_recurrent_state(checkpoint):
    """A snapshot taken after a prompt, restored into fresh caches after the cache went on, continues exactly as the
    cache did from that point; caches of different lengths merged into rows decode as each alone."""
    folder, _, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    model(mx.array(ids[:1, :12]), cache)
    snapshots = [c.snapshot() for c in cache]
    expected = np.array(model(mx.array(ids[:1, 12:14]), cache))
    restored = [c.empty() for c in cache]
    for c, snapshot in zip(restored, snapshots):
        c.restore(snapshot)
    assert np.array_equal(np.array(model(mx.array(ids[:1, 12:14]), restored)), expected)
    shorter = model.make_cache()
    model(mx.array(ids[1:, :5]), shorter)
    both = [type(a).merge([a.copy(), b.copy()]) for a, b in zip(restored, shorter)]
    step = np.array([[ids[0, 14]], [ids[1, 5]]])
    together = np.array(model(mx.array(step), both))
    for row, alone in enumerate((restored, shorter)):
        own = np.array(model(mx.array(step[row : row + 1]), alone))
        assert relative_error(together[row : row + 1], own) <= 1e-5


@pytest.mark.parametrize(
    "name, change, tensor",
    [
        ("lfm2", {"conv_L_cache": 5}, "conv1d"),  # the convolution's state: 4 columns, not 2
        ("granitemoehybrid", {"mamba_d_state": 32}, "mamba.in_proj"),  # Mamba2's state: 32 wide, not 16
        ("qwen3_5_text", {"linear_value_head_dim": 16}, "linear_attn"),  # the delta rule's: 16 x 16, not 16 x 8
    ],
)
def test_state_sizes_that_disagree_with_the_config_are_refused_from_the_headers(name, change, tensor, tmp_path):
    """Each family's recurrent state sized otherwise by the config than by its tensors: refused in one line naming the
    tensor and the config (from the tensors' shapes; tests/test_bad_inputs.py checks the CLI's exit 2 on Qwen3.5)."""
    config_class, config = CONFIGS[name]
    save_reference(tmp_path, config_class, **config)
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((tmp_path / "config.json").read_text()), **change}))
    with pytest.raises(CheckpointError, match="shape") as refusal:
        minimlx.load_model(tmp_path, dtype="float32")
    message = str(refusal.value)
    assert "\n" not in message and "config" in message and tensor in message, message


def test_unknown_layer_kind_is_refused_before_any_tensor():
    from minimlx.archs import build_model

    for model_type, config, kind in (
        ("qwen3_5_text", QWEN3_5, "mamba"),
        ("lfm2", CONFIGS["lfm2"][1], "linear_attention"),
        ("granitemoehybrid", GRANITE, "conv"),
    ):
        kinds = [kind, *config["layer_types"][1:]]
        with pytest.raises(CheckpointError, match=f"layer_types holds \\['{kind}'\\]"):
            build_model({**config, "model_type": model_type, "layer_types": kinds})


def test_convert_writes_what_it_reads_or_refuses_in_one_line(checkpoint, tmp_path):
    """`minimlx convert` of each family gives an MLX folder whose logits are transformers'; an LFM2 with a head of its
    own (mlx-lm's LFM2 always ties it) is refused in one line rather than written as a folder mlx-lm misreads."""
    from minimlx.errors import UnsupportedArchitectureError

    folder, reference, ids = checkpoint
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] == "lfm2" and not config.get("tie_word_embeddings", True):
        with pytest.raises(UnsupportedArchitectureError, match="always ties its head"):
            minimlx.convert(folder, tmp_path / "mlx")
        from click.testing import CliRunner

        from minimlx.cli import main

        result = CliRunner().invoke(main, ["convert", str(folder), str(tmp_path / "mlx")])
        assert result.exit_code == 2 and result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert result.stderr.startswith("error: ") and not (tmp_path / "mlx").exists()
        return
    model = minimlx.load_model(minimlx.convert(folder, tmp_path / "mlx"), dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def test_qwen3_5_text_is_written_inside_the_image_text_model_mlx_lm_reads(tmp_path):
    """mlx-lm has no model of the text model's own type: the folder is its `qwen3_5` one (config as `text_config`,
    tensors under `language_model`), which mlx-lm and minimlx read with transformers' logits."""
    from mlx_lm_reference import mlx_lm_logits

    config = dict(QWEN3_5, layer_types=["linear_attention"] * 3 + ["full_attention"])  # as mlx-lm reads the kinds
    torch_model = save_reference(tmp_path / "hf", "Qwen3_5TextConfig", **config)
    ids = random_ids(VOCAB, tokens=TOKENS)
    reference = reference_logits(torch_model, ids)
    written = minimlx.convert(tmp_path / "hf", tmp_path / "mlx")
    assert json.loads((written / "config.json").read_text())["model_type"] == "qwen3_5"
    assert relative_error(np.array(mlx_lm_logits(written, ids)), reference) <= 1e-4
    model = minimlx.load_model(written, dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4


def test_mlx_lm_folders_of_qwen3_next(tmp_path):
    """mlx-lm's convert of a Qwen3-Next checkpoint (its layers every `full_attention_interval`-th attending, as
    mlx-lm reads them; its norms stored whole, its convolution (channels, kernel, 1)) gives transformers' logits; and
    minimlx's convert, float and 8-bit, writes folders mlx-lm reads as minimlx does."""
    from mlx_lm_reference import mlx_lm_convert, mlx_lm_logits, save_tokenizer

    config = dict(CONFIGS["qwen3_next"][1], layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch_model = save_reference(tmp_path / "hf", "Qwen3NextConfig", **config)
    to_v4_layout(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    ids = random_ids(VOCAB, tokens=TOKENS)
    reference = reference_logits(torch_model, ids)
    folder = mlx_lm_convert(tmp_path / "hf", tmp_path / "mlx")
    model = minimlx.load_model(folder, dtype="float32")
    assert relative_error(np.array(model(mx.array(ids))), reference) <= 1e-4
    written = minimlx.convert(tmp_path / "hf", tmp_path / "ours")
    assert relative_error(mlx_lm_logits(written, ids), reference) <= 1e-4
    packed = minimlx.convert(tmp_path / "hf", tmp_path / "ours-8bit", bits=8)
    ours = np.array(minimlx.load_model(packed, dtype="float32")(mx.array(ids)))
    assert relative_error(ours, mlx_lm_logits(packed, ids)) <= 1e-4
