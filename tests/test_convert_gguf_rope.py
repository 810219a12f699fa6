"""A Llama 3.1-style GGUF converted to an MLX folder: llama.cpp's converter keeps the llama3 RoPE scaling only as a
`rope_freqs` tensor of per-frequency factors, and `minimlx convert` writes the `rope_scaling` that gives them.

The file is test_io_gguf_llamacpp.py's `llama3_scaled` model (llama3 scaling over an original context of 16 of its
128 positions), converted by llama.cpp's `convert_hf_to_gguf.py`; mlx-lm reads the MLX folder.
"""

import json
import sys
import types

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from llamacpp import llamacpp_sources
from llamacpp_models import LLAMA3_ROPE, VOCAB
from mlx_lm_reference import mlx_lm_logits
from reference import random_ids, relative_error

import minimlx
from minimlx.cli import main
from minimlx.convert import llama3_scaling
from minimlx.errors import CheckpointError

SCALING = {key: value for key, value in LLAMA3_ROPE.items() if key != "rope_theta"}


@pytest.mark.slow
def test_a_llama_3_1_gguf_converts_to_the_scaling_mlx_lm_reads(converted, tmp_path):
    """The folder's config holds the source's llama3 scaling, its frequencies are the file's, and mlx-lm's logits on
    the folder are minimlx's on the GGUF over 40 positions (past the original context of 16)."""
    gguf, out = converted / "llama3_scaled-f32.gguf", tmp_path / "mlx"
    result = CliRunner().invoke(main, ["convert", str(gguf), str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == SCALING
    from_file, from_folder = minimlx.load_model(gguf, dtype="float32"), minimlx.load_model(out, dtype="float32")
    source = minimlx.load_model(converted / "llama3_scaled", dtype="float32")
    wavelengths = [np.array(model.layers[0].attn.rope._wavelengths) for model in (from_file, from_folder, source)]
    np.testing.assert_allclose(wavelengths[0], wavelengths[2], rtol=1e-6)
    np.testing.assert_allclose(wavelengths[1], wavelengths[2], rtol=1e-6)
    ids = random_ids(VOCAB, tokens=40)
    ours, theirs = np.array(from_file(mx.array(ids))), np.array(mlx_lm_logits(out, ids))
    print(f"max |mlx-lm - minimlx| {np.abs(theirs - ours).max():.2e}, relative {relative_error(theirs, ours):.2e}")
    assert relative_error(theirs, ours) <= 1e-4


def rope_freqs(head_dim: int, **rope) -> list[float]:
    """The `rope_freqs` factors llama.cpp's converter writes for a llama3 `rope_parameters` (its own code)."""
    sys.path.append(str(llamacpp_sources()))
    from conversion.llama import LlamaModel

    hparams = {"head_dim": head_dim, "hidden_size": head_dim, "num_attention_heads": 1}
    converter = types.SimpleNamespace(
        rope_parameters=dict(rope_type="llama3", **rope), hparams=hparams, format_tensor_name=lambda name: name
    )
    ((_, factors),) = LlamaModel.generate_extra_tensors(converter)
    return factors.tolist()


@pytest.mark.parametrize(
    "head_dim, factor, original",
    [(128, 8.0, 8192), (64, 32.0, 8192)],  # Llama 3.1 8B's heads and scaling; Llama 3.2 1B's
    ids=["llama3.1", "llama3.2"],
)
def test_published_llama3_scalings_come_back_from_their_factors(head_dim, factor, original):
    rope = dict(rope_theta=500000.0, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0)
    rope["original_max_position_embeddings"] = original
    factors = rope_freqs(head_dim, **rope)
    assert 1 < len(set(factors)) < len(factors)  # some kept, some scaled, some blended
    expected = {key: value for key, value in rope.items() if key != "rope_theta"}
    assert llama3_scaling(factors, 500000.0, "x.gguf") == {"rope_type": "llama3", **expected}


def test_factors_no_llama3_scaling_gives_are_refused_in_one_line():
    with pytest.raises(CheckpointError, match="x.gguf's rope_freqs tensor is not a llama3 RoPE scaling") as error:
        llama3_scaling([1.0, 3.0, 1.0, 8.0], 10000.0, "x.gguf")
    assert "\n" not in str(error.value)
    assert llama3_scaling([1.0] * 4, 10000.0, "x.gguf") is None
