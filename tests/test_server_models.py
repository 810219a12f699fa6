"""Several models in one server (server/models.py, catalog.py): each loaded on the first request naming it, with
its own engine; requests to different models answered together; a memory budget that unloads the least recently
used idle model (never one answering) and a keep-alive that unloads idle ones, measured in the server's resident
memory; unknown and refused model names as 4xx in each API's shape."""

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from models import chat_model, write_model
from reference import require
from servers import Served

import minimlx
from minimlx.decode import Engine, Request, SamplingSettings
from minimlx.server.app import Server
from minimlx.server.catalog import Catalog, in_folder, in_hub_cache
from minimlx.server.fields import APIError
from minimlx.server.models import Models, ServedModel
from minimlx.server.residency import Residency

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]
BIG = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4)  # about 50 MB of float32 weights
MB = 1 << 20


def folder_of_models(folder, names=("tiny-a", "tiny-b", "other-c"), **shape):
    for seed, name in enumerate(names):
        chat_model(folder / name, 4096, seed=seed + 1, **shape)
    return folder


def load_served(known) -> ServedModel:
    model, tokenizer = minimlx.load(known.path)
    return ServedModel(Engine(model, tokenizer, max_batch=4), known)


def reference_ids(folder, prompts, max_tokens=16) -> list[list[int]]:
    """Each prompt's greedy ids from the model alone, in this process (an answer's end-of-sequence token is not in
    the text a server sends)."""
    model, tokenizer = minimlx.load(folder)
    engine = Engine(model, tokenizer, max_batch=4)
    runs = [engine.submit(Request(p, SamplingSettings(temperature=0, max_tokens=max_tokens))) for p in prompts]
    engine.run()
    return [[t for t in run.tokens if t not in tokenizer.eos_token_ids] for run in runs]


def completion_ids(url: str, model: str, prompt: list[int], max_tokens: int = 16) -> list[int]:
    """The greedy answer's ids, read back from its per-token logprobs (the tokenizer's words are w0, w1, ...)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        tokens = json.load(response)["choices"][0]["logprobs"]["tokens"]
    return [int(token.strip().removeprefix("w")) for token in tokens]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def loaded(url: str) -> list[str]:
    return [m["name"] for m in get(f"{url}/api/ps")["models"]]


# ---- in this process: names, refusals in each API's shape, Ollama's keep_alive 0 ----


SMALL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("tiny-a", "tiny-b", "other-c")):
        write_model(folder / name, SMALL, seed=seed)
    return folder


@pytest.fixture
def client(small_models):
    from starlette.testclient import TestClient

    models = Models(Catalog(in_folder(small_models), allow=("tiny-*",)), load_served, Residency())
    with TestClient(Server(models).app) as client:
        yield client, models


QUESTION = [{"role": "user", "content": "w3 w4"}]


@pytest.mark.parametrize(
    "path, body, shape",
    [
        ("/v1/chat/completions", {"messages": QUESTION}, lambda e: e["error"]["code"]),
        ("/v1/completions", {"prompt": "w3"}, lambda e: e["error"]["code"]),
        ("/v1/messages", {"messages": QUESTION, "max_tokens": 3}, lambda e: e["type"] == "error" and e["error"]),
        ("/v1/embeddings", {"input": "w3"}, lambda e: e["error"]["code"]),
        ("/api/chat", {"messages": QUESTION}, lambda e: list(e) == ["error"] and e["error"]),
        ("/api/generate", {"prompt": "w3"}, lambda e: list(e) == ["error"] and e["error"]),
        ("/api/show", {}, lambda e: list(e) == ["error"] and e["error"]),
    ],
)
def test_unknown_and_refused_models_are_4xx_in_each_apis_shape_at_once(client, path, body, shape):
    client, models = client
    for name, status in (("nope", 404), ("other-c", 403), ("other-c:latest", 403)):
        started = time.monotonic()
        answer = client.post(path, json={**body, "model": name})
        assert time.monotonic() - started < 1
        assert answer.status_code == status and shape(answer.json())
        assert name.split(":")[0] in json.dumps(answer.json())
    assert models.loaded == {}  # nothing was loaded for them


@pytest.mark.slow  # loads and unloads models in a served process
def test_models_are_listed_loaded_on_first_use_and_ollama_keep_alive_0_unloads(client):
    client, models = client
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-a", "tiny-b"]
    assert [m["name"] for m in client.get("/api/tags").json()["models"]] == ["tiny-a:latest", "tiny-b:latest"]
    assert client.get("/api/ps").json() == {"models": []}
    for name in ("tiny-a", "tiny-b:latest"):
        answer = client.post("/v1/completions", json={"model": name, "prompt": [3, 4], "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["model"] == name.removesuffix(":latest")
    ps = client.get("/api/ps").json()["models"]
    assert [m["name"] for m in ps] == ["tiny-a:latest", "tiny-b:latest"] and all(m["size"] > 0 for m in ps)
    metrics = client.get("/metrics").text
    assert "minimlx_models_loaded 2.0" in metrics and 'minimlx_model_memory_bytes{model="tiny-a"}' in metrics
    bad = client.post("/api/generate", json={"model": "tiny-a", "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
    unload = client.post("/api/generate", json={"model": "tiny-a", "keep_alive": 0}).json()
    assert unload["done"] and unload["done_reason"] == "unload"
    deadline = time.monotonic() + 5
    while "tiny-a" in models.loaded and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(models.loaded) == ["tiny-b"]
    load = client.post("/api/generate", json={"model": "tiny-a", "keep_alive": "5m"}).json()
    assert load["done_reason"] == "load" and sorted(models.loaded) == ["tiny-a", "tiny-b"]


# ---- serve processes: two models of about 50 MB each ----


@pytest.fixture(scope="module")
def big_models(tmp_path_factory):
    folder = folder_of_models(tmp_path_factory.mktemp("big"), ("tiny-a", "tiny-b"), **BIG)
    references = {name: reference_ids(folder / name, PROMPTS) for name in ("tiny-a", "tiny-b")}
    return folder, references


def rss(served: Served) -> int:
    return require("psutil").Process(served.process.pid).memory_info().rss


@pytest.mark.slow
def test_requests_to_two_models_are_answered_together_each_as_its_model_alone(big_models):
    folder, references = big_models
    served = Served("--model", str(folder / "tiny-a"), "--model", str(folder / "tiny-b"), "--max-batch", "4")
    try:
        asks = [(name, i) for i in range(len(PROMPTS)) for name in ("tiny-a", "tiny-b")]
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda ask: completion_ids(served.url, ask[0], PROMPTS[ask[1]]), asks))
        assert answers == [references[name][i] for name, i in asks]
        assert references["tiny-a"] != references["tiny-b"]
        assert sorted(loaded(served.url)) == ["tiny-a:latest", "tiny-b:latest"]
    finally:
        served.stop()


@pytest.mark.slow
def test_a_memory_budget_swaps_models_after_their_requests_and_keep_alive_unloads_idle_ones(big_models):
    """--max-memory below the two models' sum: tiny-b waits for tiny-a's running request, then tiny-a leaves and the
    server's resident memory does not grow by a second model; --keep-alive 5 then unloads tiny-b within 10 s (its
    memory goes back) and the next request loads it again, answering the same ids."""
    folder, references = big_models
    a, b = str(folder / "tiny-a"), str(folder / "tiny-b")
    served = Served("--model", a, "--model", b, "--max-memory", "80MB", "--keep-alive", "5")
    try:
        empty = rss(served)
        assert completion_ids(served.url, "tiny-a", PROMPTS[0]) == references["tiny-a"][0]
        with_a = rss(served)
        size = get(f"{served.url}/api/ps")["models"][0]["size"]
        long = {"model": "tiny-a", "prompt": [3, 4], "max_tokens": 400, "temperature": 0, "stream": True}
        long["logit_bias"] = {"1": -100, "2": -100}  # no end-of-sequence token: all 400 are generated
        request = urllib.request.Request(f"{served.url}/v1/completions", json.dumps(long).encode())
        stream = urllib.request.urlopen(request, timeout=60)
        stream.readline()  # tiny-a is answering
        b_answer, b_done = [], threading.Event()
        waiter = threading.Thread(
            target=lambda: b_answer.append(completion_ids(served.url, "tiny-b", PROMPTS[1])) or b_done.set()
        )
        waiter.start()
        time.sleep(0.3)
        assert not b_done.is_set() and loaded(served.url) == ["tiny-a:latest"]  # tiny-b waits for tiny-a's request
        rest = stream.read().decode()
        a_ended = time.monotonic()
        stream.close()
        assert rest.rstrip().endswith("[DONE]") and '"finish_reason": "length"' in rest
        waiter.join(timeout=60)
        assert b_answer == [references["tiny-b"][1]] and loaded(served.url) == ["tiny-b:latest"]
        with_b = rss(served)
        log = served.log()
        assert log.index("unloaded tiny-a") < log.index("loaded tiny-b")
        b_ended = time.monotonic()
        deadline = b_ended + 10
        while loaded(served.url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loaded(served.url) == [], "tiny-b was not unloaded within 10 s of idling"
        unloaded_after = time.monotonic() - b_ended
        settled = time.monotonic() + 3  # /api/ps drops a model as it starts leaving; its memory goes a moment later
        while rss(served) > with_b - 0.6 * size and time.monotonic() < settled:
            time.sleep(0.1)
        after_unload = rss(served)
        assert completion_ids(served.url, "tiny-b", PROMPTS[1]) == references["tiny-b"][1]  # loaded again
        figures = dict(size=size, empty=empty, with_a=with_a, with_b=with_b, after_unload=after_unload)
        print({k: f"{v / MB:.1f} MB" for k, v in figures.items()}, f"unloaded {unloaded_after:.1f} s after idling")
        print(f"tiny-a's request ended {a_ended:.1f}; tiny-b loaded after it")
        assert with_a - empty > 0.6 * size  # tiny-a's weights are resident
        assert with_b - with_a < 0.4 * size  # tiny-b came in for tiny-a, not beside it
        assert with_b - after_unload > 0.6 * size  # unloading gives the memory back
    finally:
        served.stop()


def test_the_catalog_finds_folders_gguf_files_and_the_hub_cache_and_maps_ollama_names(tmp_path, monkeypatch):
    models_dir = tmp_path / "models"
    (models_dir / "qwen-folder").mkdir(parents=True)
    (models_dir / "qwen-folder" / "config.json").write_text("{}")
    (models_dir / "qwen-folder" / "model.safetensors").write_bytes(b"x" * 100)
    (models_dir / "not-a-model").mkdir()
    for name in ("Llama-3.2-1B-Q4_K_M.gguf", "mmproj-vision.gguf"):
        (models_dir / name).write_bytes(b"x" * 10)
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for repo, files in (
        ("org/folder", ["config.json", "model.safetensors"]),
        ("org/quants", ["m-Q4_K_M.gguf", "m-Q8_0.gguf"]),
    ):
        snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc"
        snapshot.mkdir(parents=True)
        for file in files:
            (snapshot / file).write_text("{}")
    catalog = Catalog(in_folder(models_dir) + in_hub_cache(), allow=("*-folder", "org/*"))
    names = [k.name for k in catalog.all]
    assert names == ["Llama-3.2-1B-Q4_K_M", "qwen-folder", "org/folder", "org/quants:Q4_K_M", "org/quants:Q8_0"]
    assert [k.name for k in catalog.models] == names[1:]
    assert catalog.all[1].disk_bytes == 100
    assert catalog.named("qwen-folder:latest").name == "qwen-folder"
    assert catalog.named("org/quants:Q8_0").path.name == "m-Q8_0.gguf"
    assert catalog.named("org/quants").name == "org/quants:Q4_K_M"
    assert catalog.named(str(models_dir / "qwen-folder")).name == "qwen-folder"
    with pytest.raises(APIError) as refused:
        catalog.named("Llama-3.2-1B-Q4_K_M")
    assert refused.value.status == 403
    with pytest.raises(APIError) as unknown:
        catalog.named("gpt-4o", strict=True)
    assert unknown.value.status == 404 and "qwen-folder" in unknown.value.message
