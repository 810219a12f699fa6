"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed`, computed by the model's
`Embedder` (minimlx/embedding.py) on the engine's thread, between decode steps. The pooling comes from the model's
sentence-transformers files or serve's --pooling, and each answer says which it was."""

import base64
import time
from typing import TYPE_CHECKING

import numpy as np
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import InvalidSettingError
from .fields import APIError, bad, ignore_unread, integer, optional
from .ollama import held_model

if TYPE_CHECKING:
    from .models import ServedModel
    from .protocol import TurnServer

MAX_INPUTS = 2048  # texts in one request (OpenAI's limit)


class EmbeddingAPI:
    """/v1/embeddings, Ollama's /api/embed and /v1/rerank over the Embedder and Reranker of the model a request names
    (either may be missing: the endpoint then answers 400), computed on that model's engine thread (`bridge.run`)."""

    def __init__(self, server: "TurnServer"):
        self.server = server

    @staticmethod
    def texts_of(body, param: str) -> list:
        given = body.get(param)
        texts = [given] if isinstance(given, str) or is_ids(given) else given
        if not isinstance(texts, list) or not texts:
            raise bad(param, f"'{param}' must be a non-empty string, list of strings, or token ids")
        if len(texts) > MAX_INPUTS:
            raise bad(param, f"'{param}' holds {len(texts)} texts; this server embeds at most {MAX_INPUTS} at once")
        if not all(isinstance(t, str) and t or is_ids(t) for t in texts):
            raise bad(param, f"each of '{param}' must be a non-empty string or a list of token ids")
        return texts

    async def embed(self, body, param: str, api: str, model: "ServedModel") -> tuple[np.ndarray, int]:
        if model.embedder is None:
            message = (
                "this model has no pooling (no sentence-transformers modules.json): it makes no embeddings; start "
                "the server with --pooling mean|lasttoken|cls for a decoder's hidden states"
            )
            raise APIError(400, message, "model", "model_not_supported")
        texts = self.texts_of(body, param)
        dimensions = integer(body, "dimensions", None)
        ignore_unread(body, api)
        ids = model.embedder.ids(texts)
        longest, context = max(len(row) for row in ids), model.engine.context
        if context is not None and longest > context:
            message = f"a text of '{param}' holds {longest} tokens; this model reads at most {context}"
            raise APIError(400, message, param, "context_length_exceeded")
        try:
            vectors = await model.bridge.run(lambda: model.embedder(ids, dimensions))
        except InvalidSettingError as e:
            raise bad(e.field or param, str(e)) from None
        return vectors, sum(len(row) for row in ids)

    async def openai_embeddings(self, request: HTTPRequest):
        body = await self.server.read(request)
        encoding = optional(body, "encoding_format", str, '"float" or "base64"') or "float"
        if encoding not in ("float", "base64"):
            raise bad("encoding_format", f'\'encoding_format\' must be "float" or "base64", got {encoding!r}')
        body.get("user")
        model = await self.server.model(body)
        vectors, tokens = await self.embed(body, "input", "embeddings", model)
        data = [
            {"object": "embedding", "index": i, "embedding": encoded(vector, encoding)}
            for i, vector in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        reply = {"object": "list", "data": data, "model": model.name, "usage": usage}
        return JSONResponse(reply | {"pooling": model.embedder.pooling.mode}, headers=body.headers())

    async def ollama_embed(self, request: HTTPRequest):
        started = time.monotonic_ns()
        body = await self.server.read(request)
        for name in ("truncate", "options"):
            body.get(name)
        model = await held_model(self.server, body, strict=False)
        vectors, tokens = await self.embed(body, "input", "ollama", model)
        total = time.monotonic_ns() - started
        reply = {"model": model.name, "embeddings": vectors.tolist(), "total_duration": total}
        reply |= {"load_duration": 0, "prompt_eval_count": tokens, "pooling": model.embedder.pooling.mode}
        return JSONResponse(reply, headers=body.headers())

    async def rerank(self, request: HTTPRequest):
        """The Cohere/Jina shape llama-server and vLLM answer: `query`, `documents` (strings or {"text"}),
        `top_n`, `return_documents`, `instruction`; results best first, scored as Qwen3-Reranker's card defines."""
        body = await self.server.read(request)
        query = optional(body, "query", str, "a string")
        if not query:
            raise bad("query", "'query' must be a non-empty string")
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise bad("documents", "'documents' must be a non-empty list of strings or {\"text\": ...} objects")
        if len(documents) > MAX_INPUTS:
            raise bad("documents", f"'documents' holds {len(documents)}; this server ranks at most {MAX_INPUTS}")
        texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
        if not all(isinstance(t, str) for t in texts):
            raise bad("documents", 'each document must be a string or {"text": ...}')
        top_n = integer(body, "top_n", len(texts))
        if top_n < 1:
            raise bad("top_n", f"'top_n' must be at least 1, got {top_n}")
        instruction = optional(body, "instruction", str, "a string")
        given_documents = body.get("return_documents", False) is True
        ignore_unread(body, "rerank")
        model = await self.server.model(body)
        if model.reranker is None:
            message = "this model's vocabulary has no single 'yes' and 'no' tokens, which reranking scores with"
            raise APIError(400, message, "model", "model_not_supported")
        prompts = [model.reranker.prompt(query, text, instruction) for text in texts]
        scores = await model.bridge.run(lambda: model.reranker.scores(prompts))
        best = sorted(range(len(texts)), key=lambda i: -scores[i])[:top_n]
        results = [
            {"index": i, "relevance_score": float(scores[i])}
            | ({"document": {"text": texts[i]}} if given_documents else {})
            for i in best
        ]
        tokens = sum(len(prompt) for prompt in prompts)
        reply = {"model": model.name, "results": results, "usage": {"total_tokens": tokens}}
        return JSONResponse(reply, headers=body.headers())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/embeddings", self.openai_embeddings, methods=["POST"]),
            Route("/api/embed", self.ollama_embed, methods=["POST"]),
            Route("/v1/rerank", self.rerank, methods=["POST"]),
        ]


def is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def encoded(vector: np.ndarray, encoding: str):
    """A vector as OpenAI sends it: a list of floats, or base64 of its float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.astype(np.float32).tobytes()).decode()
    return vector.tolist()
