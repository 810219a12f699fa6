"""MLX folders as mlx-lm writes them: quantized (4-bit, 8-bit, the mixed_3_6 recipe) and bfloat16.

Tiny random llama (llama3 RoPE scaling), qwen3, qwen3_moe and deepseek_v3 models are converted by
mlx-lm itself; minimlx loads its output with the packed weights dequantized to float32 and kept
packed, and both must give mlx-lm's own float32 logits on the same folder.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm_reference import CONFIGS, VOCAB, mlx_lm_convert, mlx_lm_logits
from reference import random_ids, relative_error

import minimlx
from minimlx.errors import CheckpointError

VARIANTS = {
    "4bit-g64": dict(quantize=True, q_bits=4, q_group_size=64),
    "8bit-g32": dict(quantize=True, q_bits=8, q_group_size=32),
    "mixed_3_6": dict(quantize=True, q_group_size=64, quant_predicate="mixed_3_6"),
    "bfloat16": dict(dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def mlx_lm_folder(tmp_path_factory, hf_folder):
    built = {}

    def get(name, variant):
        if (name, variant) not in built:
            target = tmp_path_factory.mktemp(f"mlx-{name}") / variant
            built[name, variant] = mlx_lm_convert(hf_folder(name), target, **VARIANTS[variant])
        return built[name, variant]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mlx_lm_folder_matches_mlx_lm(mlx_lm_folder, name, variant):
    folder = mlx_lm_folder(name, variant)
    ids = random_ids(VOCAB)
    expected = np.array(mlx_lm_logits(folder, ids))
    for dtype in ("float32", "quantized"):
        model = minimlx.load_model(folder, dtype=dtype)
        logits = model(mx.array(ids)).astype(mx.float32)
        assert relative_error(np.array(logits), expected) < 1e-4, (dtype, relative_error(np.array(logits), expected))


def test_packed_modules_are_kept_packed(mlx_lm_folder):
    """Quantized experts, latent attention's per-head maps, the router and the embedding stay packed."""
    model = minimlx.load_model(mlx_lm_folder("deepseek_v3", "4bit-g64"), dtype="quantized")
    moe_layer = model.layers[1]
    for module in (
        model.embed,
        moe_layer.attn.key_up_proj,
        moe_layer.attn.value_up_proj,
        moe_layer.attn.q_b_proj,
        moe_layer.ffn.experts.gate_proj,
        moe_layer.ffn.shared_experts.down_proj,
        model.head,
    ):
        assert module.weight.dtype == mx.uint32 and module.bits == 4 and module.group_size == 64
    mixed = minimlx.load_model(mlx_lm_folder("qwen3_moe", "mixed_3_6"), dtype="quantized")
    assert mixed.layers[1].attn.v_proj.bits == 6 and mixed.layers[0].attn.v_proj.bits == 3  # the last eighth: more bits
    plain = minimlx.load_model(mlx_lm_folder("qwen3_moe", "4bit-g64"), dtype="quantized")
    assert plain.layers[0].ffn.router.proj.bits == 8  # mlx-lm's own rule for qwen3_moe's router


def rewrite_config(folder, target, change):
    target.mkdir()
    for item in folder.iterdir():
        (target / item.name).symlink_to(item)
    (target / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_quantization_entry_with_unusable_bits(mlx_lm_folder, tmp_path):
    folder = rewrite_config(
        mlx_lm_folder("qwen3", "4bit-g64"), tmp_path / "bad", lambda c: c["quantization"].update(bits=7)
    )
    with pytest.raises(
        CheckpointError, match=r"bits=7, which affine quantization cannot use \(supported: 2, 3, 4, 5, 6, 8\)"
    ):
        minimlx.load_model(folder)


def test_packed_weight_that_disagrees_with_the_declared_bits(mlx_lm_folder, tmp_path):
    def declare_8_bits(config):
        config["quantization"] = {"group_size": 64, "bits": 8, "mode": "affine"}
        config["quantization_config"] = config["quantization"]

    folder = rewrite_config(mlx_lm_folder("qwen3", "4bit-g64"), tmp_path / "bad", declare_8_bits)
    with pytest.raises(
        CheckpointError, match=r"tensor .*weight has packed shape \(\d+, 8\).* does not fit 8-bit affine"
    ):
        minimlx.load_model(folder)


@pytest.mark.parametrize("variant", ["4bit-g64", "bfloat16"])
def test_gpt2_folder_from_mlx_lm(tmp_path, variant):
    """mlx-lm stores GPT-2 under `model.h.*` with its Conv1D weights transposed and c_attn still fused."""
    from mlx_lm_reference import save_tokenizer
    from reference import save_reference, to_v4_layout

    source = tmp_path / "hf"
    save_reference(source, "GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    to_v4_layout(source)
    tensors = mx.load(str(source / "model.safetensors"))  # published GPT-2 files lack transformers 5's prefix
    mx.save_safetensors(
        str(source / "model.safetensors"), {k.removeprefix("transformer."): v for k, v in tensors.items()}
    )
    save_tokenizer(source)
    folder = mlx_lm_convert(source, tmp_path / variant, **VARIANTS[variant])
    assert "model.h.0.attn.c_attn.weight" in mx.load(str(folder / "model.safetensors"))
    ids = random_ids(VOCAB)
    logits = minimlx.load_model(folder, dtype="float32")(mx.array(ids))
    assert relative_error(np.array(logits), np.array(mlx_lm_logits(folder, ids))) < 1e-4


def test_bad_quantized_files_give_one_line_and_exit_2(mlx_lm_folder, tmp_path):
    """The command line's side of the errors above, and of a GGUF tensor type nothing can read."""
    from click.testing import CliRunner
    from command_line import one_line_error
    from gguf_files import write_tensors

    from minimlx.cli import main

    seven = rewrite_config(
        mlx_lm_folder("qwen3", "4bit-g64"), tmp_path / "seven", lambda c: c["quantization"].update(bits=7)
    )
    eight = rewrite_config(
        mlx_lm_folder("qwen3", "4bit-g64"),
        tmp_path / "eight",
        lambda c: c.update(quantization={"group_size": 64, "bits": 8}),
    )
    q8_k = write_tensors(tmp_path / "q8_k.gguf", {"blk.0.attn_q.weight": (np.zeros((2, 292), np.uint8), "Q8_K")})
    runner = CliRunner()
    one_line_error(runner.invoke(main, ["run", "w2", "--model", str(seven)]), "bits=7", "re-convert the model")
    one_line_error(runner.invoke(main, ["run", "w2", "--model", str(eight)]), "does not fit 8-bit affine")
    one_line_error(runner.invoke(main, ["run", "w2", "--model", str(q8_k)]), "type Q8_K is not supported")
