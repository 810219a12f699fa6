"""Model names: a Hugging Face repo id found in the local cache loads with its tokenizer and generates."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import minimlx
from minimlx.errors import ModelNotFoundError
from minimlx.io.resolve import resolve
from reference import require, save_reference

VOCAB = 64
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
)


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache holding `org/tiny` (a random llama and a word-level tokenizer), and its torch model."""
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abc")
    torch_model = save_reference(snapshot, "LlamaConfig", **CONFIG)
    words = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    return snapshot, torch_model


def test_repo_id_resolves_to_the_cached_snapshot(hub):
    snapshot, _ = hub
    assert resolve("org/tiny") == snapshot


def test_repo_id_loads_and_greedy_ids_match_transformers(hub):
    torch = require("torch")
    _, torch_model = hub
    model, tokenizer = minimlx.load("org/tiny", dtype="float32")
    prompt = tokenizer.encode("w5 w17 w42 w3")
    assert prompt == [5, 17, 42, 3]
    ours = [r.token for r in minimlx.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    with torch.no_grad():
        theirs = torch_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert ours == theirs[0, len(prompt) :].tolist()
    assert np.unique(ours).size > 1  # a real continuation, not one repeated id


def test_repo_id_missing_from_the_cache(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the download attempt must fail at once, not wait on a network
    with pytest.raises(ModelNotFoundError, match="neither a folder nor in the Hugging Face cache"):
        resolve("org/absent")
