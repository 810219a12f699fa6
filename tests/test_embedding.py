"""Embeddings: tiny random decoders saved by sentence-transformers with their pooling files (last-token like
Qwen3-Embedding, mean with a Dense layer like EmbeddingGemma's head) give the vectors sentence-transformers' `encode`
gives, batched and alone, through Python, `/v1/embeddings` (the `openai` client) and `/api/embed` (the `ollama`
client); the pooling is read from the files and named in the answers."""

import base64
import json
import random
from pathlib import Path

import numpy as np
import pytest
from llamacpp import smollm2_tokenizer
from models import smollm2_path
from reference import require
from servers import Served

import minimlx
from minimlx.embedding import Embedder
from minimlx.errors import InvalidSettingError

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jet planes near river banks".split()


def texts(count: int = 50, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 5, 17, 60, 150]))) for _ in range(count)]


def tiny_qwen3(vocab: int):
    """The config of a tiny random Qwen3 stack over a vocabulary of `vocab` tokens."""
    transformers = require("transformers")
    return transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    )


def save_embedding_model(folder: Path, pooling: str, dense: bool) -> Path:
    """A tiny random Qwen3 stack saved by sentence-transformers with `pooling`, an optional Dense layer and Normalize;
    SmolLM2's tokenizer without a chat template (sentence-transformers would render texts through one)."""
    torch, transformers = require("torch"), require("transformers")
    st = require("sentence_transformers")
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer(Path(smollm2_path())))
    tokenizer.chat_template = None
    config = tiny_qwen3(len(tokenizer))
    torch.manual_seed(0)
    base = folder / "base"
    transformers.Qwen3Model(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    modules = [Transformer(str(base)), Pooling(64, pooling)]
    if dense:
        modules.append(Dense(64, 32, activation_function=torch.nn.Tanh()))
    model = st.SentenceTransformer(modules=[*modules, Normalize()], device="cpu")
    model.save(str(folder / "model"))
    return folder / "model"


@pytest.fixture(scope="module", params=[("lasttoken", False), ("mean", True)], ids=["lasttoken", "mean-dense"])
def embedding_model(request, tmp_path_factory):
    return save_embedding_model(tmp_path_factory.mktemp("embedding"), *request.param)


def reference_vectors(folder: Path, inputs: list[str]) -> np.ndarray:
    st = require("sentence_transformers")
    return st.SentenceTransformer(str(folder), device="cpu").encode(inputs, batch_size=7)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_vectors_equal_sentence_transformers_batched_and_alone(embedding_model):
    inputs = texts()
    reference = reference_vectors(embedding_model, inputs)
    embedder = Embedder.load(embedding_model, dtype="float32")
    assert embedder.pooling.mode in ("lasttoken", "mean") and embedder.pooling.normalize
    batched = minimlx.embed(embedder, inputs)
    alone = np.stack([embedder([text])[0] for text in inputs[:10]])
    assert cosines(batched, reference).min() >= 0.99999
    assert cosines(alone, reference[:10]).min() >= 0.99999
    truncated = minimlx.embed(embedder, inputs[:3], dimensions=16)
    assert truncated.shape == (3, 16) and np.allclose(np.linalg.norm(truncated, axis=1), 1, atol=1e-5)


def test_a_model_without_pooling_files_needs_a_named_pooling(tmp_path):
    from mlx_lm_reference import save_hf_model

    save_hf_model(tmp_path, "llama")
    with pytest.raises(InvalidSettingError, match="pooling"):
        Embedder.load(tmp_path)
    assert Embedder.load(tmp_path, pooling="mean").pooling.mode == "mean"
    with pytest.raises(InvalidSettingError, match="pooling"):
        Embedder.load(tmp_path, pooling="median")


@pytest.mark.slow
def test_the_servers_embeddings_equal_sentence_transformers(embedding_model):
    openai, ollama = require("openai"), require("ollama")
    inputs = texts(20, seed=1)
    reference = reference_vectors(embedding_model, inputs)
    served = Served("--model", str(embedding_model))
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model="m", input=inputs)
        vectors = np.array([d.embedding for d in reply.data])
        assert cosines(vectors, reference).min() >= 0.99999 and reply.usage.prompt_tokens > len(inputs)
        encoded = client.embeddings.create(model="m", input=inputs[:2], encoding_format="base64")
        decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype=np.float32) for d in encoded.data]
        assert np.allclose(decoded, vectors[:2], atol=1e-6)
        raw = served.post("/v1/embeddings", {"input": inputs[0]})[1]
        assert raw["pooling"] == json.loads((embedding_model / "1_Pooling" / "config.json").read_text())["pooling_mode"]
        ollama_vectors = np.array(ollama.Client(host=served.url).embed(model="m", input=inputs).embeddings)
        assert cosines(ollama_vectors, reference).min() >= 0.99999
        for body in ({"input": []}, {"input": ["x"] * 10_000}, {"input": [""]}, {"input": "x", "dimensions": 0}):
            status, refusal = served.post("/v1/embeddings", body)
            assert status == 400 and refusal["error"]["param"] in ("input", "dimensions"), (body, refusal)
        status, refusal = served.post("/api/embed", {"model": "m", "input": []})
        assert status == 400 and set(refusal) == {"error"}
    finally:
        served.stop()


@pytest.mark.slow
def test_a_chat_model_without_pooling_refuses_embeddings(tmp_path):
    from mlx_lm_reference import save_hf_model

    save_hf_model(tmp_path, "llama")
    served = Served("--model", str(tmp_path))
    try:
        status, refusal = served.post("/v1/embeddings", {"input": "w3 w4"})
        assert status == 400 and "--pooling" in refusal["error"]["message"]
    finally:
        served.stop()
    pooled = Served("--model", str(tmp_path), "--pooling", "mean")
    try:
        status, reply = pooled.post("/v1/embeddings", {"input": ["w3 w4", "w5"]})
        assert status == 200 and reply["pooling"] == "mean" and len(reply["data"]) == 2
    finally:
        pooled.stop()


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory):
    """A tiny random Qwen3 language model with SmolLM2's tokenizer (which has `yes`, `no` and the chat markers)."""
    torch, transformers = require("torch"), require("transformers")
    folder = tmp_path_factory.mktemp("reranker")
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer(Path(smollm2_path())))
    config = tiny_qwen3(len(tokenizer))
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


QUERY, DOCUMENTS = "What is the capital of France?", ["Paris is the capital of France.", "The sea is blue.", "w"]


def model_card_scores(folder: Path, query: str, documents: list[str]) -> np.ndarray:
    """Qwen3-Reranker's model card formula, computed with transformers."""
    torch, transformers = require("torch"), require("transformers")
    from minimlx.embedding import Reranker

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in documents:
        text = f"<Instruct>: {minimlx.embedding.RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = tokenizer(Reranker.PREFIX + text + Reranker.SUFFIX, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.stack([logits[no], logits[yes]]).log_softmax(0)[1].exp().item())
    return np.array(scores)


def test_rerank_scores_are_the_model_cards(reranker_folder):
    from minimlx.embedding import Reranker

    model, tokenizer = minimlx.load(reranker_folder, dtype="float32")
    ours = Reranker(model, tokenizer)(QUERY, DOCUMENTS)
    assert np.abs(ours - model_card_scores(reranker_folder, QUERY, DOCUMENTS)).max() <= 1e-4


@pytest.mark.slow
def test_the_servers_rerank_ranks_as_the_model_card_scores(reranker_folder):
    reference = model_card_scores(reranker_folder, QUERY, DOCUMENTS)
    served = Served("--model", str(reranker_folder))
    try:
        body = {"query": QUERY, "documents": [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]], "top_n": 2}
        status, reply = served.post("/v1/rerank", body | {"return_documents": True})
        assert status == 200
        best = np.argsort(-reference)[:2]
        assert [r["index"] for r in reply["results"]] == list(best)
        for result in reply["results"]:
            assert abs(result["relevance_score"] - reference[result["index"]]) <= 1e-4
            assert result["document"]["text"] == DOCUMENTS[result["index"]]
        for bad_body in ({"query": QUERY}, {"query": QUERY, "documents": []}, {"documents": DOCUMENTS}):
            status, refusal = served.post("/v1/rerank", bad_body)
            assert status == 400 and refusal["error"]["param"] in ("documents", "query"), refusal
    finally:
        served.stop()
