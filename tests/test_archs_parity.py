"""Dense architectures against transformers: logits, both config layouts, cached decoding, load errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from reference import (
    random_ids,
    reference_checkpoint,
    reference_logits,
    relative_error,
    save_reference,
    to_v4_layout,
)

import minimlx
from minimlx.errors import CheckpointError, UnsupportedArchitectureError

VOCAB = 96

CONFIGS = {
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64, activation_function="gelu_new"),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return reference_checkpoint(tmp_path_factory, request.param, *CONFIGS[request.param], VOCAB)


def logits_of(folder, ids):
    model = minimlx.load_model(folder, dtype="float32")
    return model, np.array(model(mx.array(ids)))


def test_logits_match_transformers(checkpoint):
    _, folder, reference, ids = checkpoint
    _, logits = logits_of(folder, ids)
    assert logits.shape == reference.shape == (2, 16, VOCAB)
    assert relative_error(logits, reference) <= 1e-4


def test_transformers4_config_layout(checkpoint, tmp_path):
    name, folder, reference, ids = checkpoint
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    to_v4_layout(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in config and "dtype" not in config
    _, logits = logits_of(tmp_path, ids)
    assert relative_error(logits, reference) <= 1e-4


def test_gpt2_without_transformer_prefix(tmp_path):
    config_class, config = CONFIGS["gpt2"]
    torch_model = save_reference(tmp_path, config_class, **config)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("transformer.") for k in weights)
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), {k.removeprefix("transformer."): v for k, v in weights.items()}
    )
    ids = random_ids(VOCAB)
    _, logits = logits_of(tmp_path, ids)
    assert relative_error(logits, reference_logits(torch_model, ids)) <= 1e-4


def test_token_by_token_cache_matches_full_forward(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    for t in range(ids.shape[1]):
        step = model(mx.array(ids[:, t : t + 1]), cache=cache)
    assert cache[0].offset == ids.shape[1]
    assert relative_error(np.array(step[:, -1]), reference[:, -1]) <= 1e-4


def test_chunked_prefill_then_decode_matches(checkpoint):
    _, folder, reference, ids = checkpoint
    model = minimlx.load_model(folder, dtype="float32")
    cache = model.make_cache()
    first = model(mx.array(ids[:, :11]), cache=cache)
    rest = model(mx.array(ids[:, 11:]), cache=cache)
    logits = np.concatenate([np.array(first), np.array(rest)], axis=1)
    assert relative_error(logits, reference) <= 1e-4


def test_sharded_checkpoint(tmp_path):
    config_class, config = CONFIGS["llama"]
    torch_model = save_reference(tmp_path, config_class, **config)
    torch_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = random_ids(VOCAB)
    _, logits = logits_of(tmp_path, ids)
    assert relative_error(logits, reference_logits(torch_model, ids)) <= 1e-4


def test_dtype_defaults_to_checkpoint_and_can_be_overridden(checkpoint):
    _, folder, _, _ = checkpoint
    assert minimlx.load_model(folder).embed.weight.dtype == mx.float32
    assert minimlx.load_model(folder, dtype="bfloat16").embed.weight.dtype == mx.bfloat16


def copy_checkpoint(folder, target):
    for f in folder.iterdir():
        (target / f.name).write_bytes(f.read_bytes())


def test_unknown_model_type_lists_registered(checkpoint, tmp_path):
    _, folder, _, _ = checkpoint
    copy_checkpoint(folder, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "frobnicator"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as e:
        minimlx.load_model(tmp_path)
    message = str(e.value)
    assert "\n" not in message
    assert "'frobnicator'" in message and "llama" in message and "gpt2" in message and "qwen3" in message


def test_missing_tensor_is_named(tmp_path):
    config_class, config = CONFIGS["llama"]
    save_reference(tmp_path, config_class, **config)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.ffn\.down_proj\.weight'") as e:
        minimlx.load_model(tmp_path)
    assert "\n" not in str(e.value)


def test_wrongly_shaped_tensor_is_named(tmp_path):
    config_class, config = CONFIGS["llama"]
    save_reference(tmp_path, config_class, **config)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = mx.zeros((8, 64))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError) as e:
        minimlx.load_model(tmp_path)
    message = str(e.value)
    assert "\n" not in message
    assert "model.layers.0.self_attn.k_proj.weight" in message and "(8, 64)" in message and "(32, 64)" in message


def test_unexpected_tensor_is_named(tmp_path):
    config_class, config = CONFIGS["qwen3"]
    save_reference(tmp_path, config_class, **config)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.extra.weight"] = mx.zeros((4,))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="unexpected tensor .*self_attn.extra.weight"):
        minimlx.load_model(tmp_path)


def test_registry_lists_dense_families():
    assert {"gpt2", "llama", "qwen3"} <= set(minimlx.list_archs())
