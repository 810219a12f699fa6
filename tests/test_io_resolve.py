"""Model names: a Hugging Face repo id found in the local cache loads with its tokenizer and generates; a repo of GGUF
files gives one, named or alone, and only a named one is downloaded."""

import json

import numpy as np
import pytest
from reference import require, save_reference
from tokenizers import Tokenizer, models, pre_tokenizers

import minimlx
from minimlx.errors import ModelNotFoundError
from minimlx.io.resolve import resolve

VOCAB = 64
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
)


def cached_repo(cache, repo_id: str, *files: str):
    """A snapshot of `repo_id` in the Hugging Face cache layout, holding `files` (empty)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    for name in files:
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).touch()
    return snapshot


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache holding `org/tiny` (a random llama and a word-level tokenizer), and its torch model."""
    snapshot = cached_repo(tmp_path, "org/tiny")
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
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache and this machine is offline"):
        resolve("org/absent")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, and a hub that has nothing: tests replace what they expect to be called."""
    huggingface_hub = require("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, lambda *args, **kwargs: pytest.fail("no download expected"))
    return tmp_path


def test_repo_of_one_gguf_resolves_to_it(cache):
    snapshot = cached_repo(cache, "org/tiny-GGUF", "tiny.Q4_K_M.gguf", "README.md")
    assert resolve("org/tiny-GGUF") == snapshot / "tiny.Q4_K_M.gguf"


def test_repo_of_several_ggufs_asks_for_one(cache):
    cached_repo(cache, "org/tiny-GGUF", "tiny.Q8_0.gguf", "tiny.Q4_K_M.gguf")
    with pytest.raises(
        ModelNotFoundError,
        match=r"several GGUF files \(tiny.Q4_K_M.gguf, tiny.Q8_0.gguf\); "
        r"name one, as in org/tiny-GGUF/tiny.Q4_K_M.gguf",
    ):
        resolve("org/tiny-GGUF")


def test_named_gguf_resolves_in_the_cached_snapshot(cache):
    snapshot = cached_repo(cache, "org/tiny-GGUF", "tiny.Q8_0.gguf", "q4/tiny.Q4_K_M.gguf")
    assert resolve("org/tiny-GGUF/tiny.Q8_0.gguf") == snapshot / "tiny.Q8_0.gguf"
    assert resolve("org/tiny-GGUF/q4/tiny.Q4_K_M.gguf") == snapshot / "q4" / "tiny.Q4_K_M.gguf"


def test_checkpoint_folder_wins_over_its_ggufs(cache):
    snapshot = cached_repo(cache, "org/tiny", "config.json", "model.safetensors", "tiny.Q8_0.gguf")
    assert resolve("org/tiny") == snapshot


def test_named_gguf_missing_from_the_cache_downloads_alone(cache, monkeypatch):
    huggingface_hub = require("huggingface_hub")
    asked = []
    monkeypatch.setattr(
        huggingface_hub,
        "hf_hub_download",
        lambda repo_id, filename, **where: asked.append((repo_id, filename)) or str(cache / filename),
    )
    cached_repo(cache, "org/tiny-GGUF", "tiny.Q8_0.gguf")
    assert resolve("org/tiny-GGUF/tiny.Q4_K_M.gguf") == cache / "tiny.Q4_K_M.gguf"
    assert asked == [("org/tiny-GGUF", "tiny.Q4_K_M.gguf")]


def test_named_gguf_that_cannot_be_downloaded(cache, monkeypatch):
    huggingface_hub = require("huggingface_hub")

    def offline(repo_id, filename, **where):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline, and not in the cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ModelNotFoundError, match="org/absent is not in the Hugging Face cache and this machine is"):
        resolve("org/absent/tiny.Q4_K_M.gguf")


def test_repo_download_leaves_ggufs_out(cache, monkeypatch):
    """A folder repo that also holds GGUF files: only the checkpoint's files are fetched."""
    huggingface_hub = require("huggingface_hub")
    listed = ["README.md", "config.json", "model.safetensors", "tiny.Q4_K_M.gguf", "tokenizer.json"]
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id: listed)
    fetched, snapshot = [], cache / "models--org--remote" / "snapshots" / "0123abc"

    def download(repo_id, filename, **where):
        fetched.append(filename)
        (snapshot / filename).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / filename).touch()
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert resolve("org/remote") == snapshot
    assert fetched == ["config.json", "model.safetensors", "tokenizer.json"]
