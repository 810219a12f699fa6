"""Models from the Hub against a local stand-in for it (tests/hub_standin.py, `HF_ENDPOINT`), huggingface_hub doing
the requests: folder and GGUF repos, `:QUANT` picking, an interrupted download resumed, a gated repo, a missing one
and an offline machine each one line and exit status 2; `ls` and `rm`; download on first use."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from hub_standin import StandinHub
from mlx_lm_reference import save_hf_model

import minimlx
from minimlx.errors import ModelNotFoundError
from minimlx.io import hub


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A stand-in hub serving org/tiny (a folder repo), org/tiny-GGUF (two quantizations) and a gated org/secret;
    an empty Hugging Face cache."""
    root = tmp_path / "hub"
    save_hf_model(root / "org" / "tiny", "llama")
    ggufs = root / "org" / "tiny-GGUF"
    ggufs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for tag, size in (("Q4_K_M", 300_000), ("Q8_0", 24_000_000)):  # above huggingface_hub's 10 MB write chunks
        (ggufs / f"tiny-{tag}.gguf").write_bytes(rng.bytes(size))
    (root / "org" / "secret").mkdir()
    served = StandinHub(root, gated=("org/secret",))
    cache = tmp_path / "cache"
    for name, value in {"HF_ENDPOINT": served.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield served, root, cache
    served.stop()


def minimlx_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minimlx", *args], capture_output=True, text=True, env=os.environ)


def test_a_folder_repo_is_pulled_and_loads_as_the_local_folder(standin):
    served, root, cache = standin
    path = hub.pull("org/tiny")
    assert (path / "config.json").is_file() and path.is_relative_to(cache)
    pulled = minimlx.load(path)[0](mx.array([[3, 4, 5]]))
    local = minimlx.load(root / "org" / "tiny")[0](mx.array([[3, 4, 5]]))
    assert np.array_equal(np.array(pulled), np.array(local))
    model, _ = minimlx.load("org/tiny")  # by repo id: from the cache now
    assert model is not None


def test_a_gguf_repo_gives_the_file_its_tag_names(standin):
    served, root, _ = standin
    q8 = hub.pull("org/tiny-GGUF:Q8_0")
    assert q8.name == "tiny-Q8_0.gguf" and q8.read_bytes() == (root / "org/tiny-GGUF/tiny-Q8_0.gguf").read_bytes()
    assert hub.pull("org/tiny-GGUF").name == "tiny-Q4_K_M.gguf"  # llama.cpp's default tag
    with pytest.raises(ModelNotFoundError, match="Q4_K_M, Q8_0"):
        hub.pull("org/tiny-GGUF:Q2_K")


@pytest.mark.slow  # a download through a local server, cut and resumed
def test_an_interrupted_download_resumes(standin):
    """A connection dropped halfway through a file: the download goes on from the bytes already written (a Range
    request), not from the start."""
    served, root, _ = standin
    served.cut_once.add("tiny-Q8_0.gguf")
    path = hub.pull("org/tiny-GGUF:Q8_0")
    assert path.read_bytes() == (root / "org/tiny-GGUF/tiny-Q8_0.gguf").read_bytes()
    [resumed] = served.ranges
    assert 0 < int(resumed.removeprefix("bytes=").split("-")[0]) <= 12_000_000


@pytest.mark.slow
def test_refusals_are_one_line_and_exit_2(standin, monkeypatch):
    for spec, words in (("org/secret", "gated"), ("org/none", "not on the Hub"), ("nonsense", "repo id")):
        result = minimlx_cli("pull", spec)
        assert result.returncode == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert "HF_TOKEN" in result.stderr or words == "repo id"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = minimlx_cli("pull", "org/tiny")
    assert result.returncode == 2 and "offline" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_ls_rm_and_offline_reading_of_the_cache(standin, monkeypatch):
    hub.pull("org/tiny")
    hub.pull("org/tiny-GGUF:Q8_0")
    listed = minimlx_cli("ls").stdout.splitlines()
    assert [line.split()[0] for line in listed] == ["org/tiny", "org/tiny-GGUF"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.pull("org/tiny-GGUF:Q8_0").name == "tiny-Q8_0.gguf"  # from the cache, with no request
    removed = minimlx_cli("rm", "org/tiny-GGUF")
    assert removed.returncode == 0 and "removed org/tiny-GGUF" in removed.stdout
    assert [line.split()[0] for line in minimlx_cli("ls").stdout.splitlines()] == ["org/tiny"]
    assert minimlx_cli("rm", "org/tiny-GGUF").returncode == 2


@pytest.mark.slow
def test_the_ollama_clients_pull_downloads_through_the_server(standin):
    """`ollama.Client.pull` against `minimlx serve`: the server pulls from the (stand-in) Hub into its cache."""
    from reference import require
    from servers import Served

    ollama = require("ollama")
    served, root, cache = standin
    server = Served("--model", str(root / "org" / "tiny"))
    try:
        client = ollama.Client(host=server.url)
        progress = list(client.pull("org/tiny-GGUF:Q8_0", stream=True))
        assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
        assert (cache / "models--org--tiny-GGUF").is_dir()
        with pytest.raises(ollama.ResponseError, match="gated"):
            client.pull("org/secret")
    finally:
        server.stop()


def test_a_repo_id_downloads_on_first_use(standin):
    served, root, cache = standin
    model, tokenizer = minimlx.load("org/tiny")  # nothing in the cache yet: run and serve fetch it the same way
    assert (cache / "models--org--tiny").is_dir() and tokenizer.encode("w3 w4")
    path = minimlx.io.resolve.resolve("org/tiny-GGUF:Q8_0")
    assert path.name == "tiny-Q8_0.gguf"
