"""Text embeddings: a model's final hidden states pooled into one vector per text, as sentence-transformers computes
them from the same folder.

The pooling is read from the model's sentence-transformers files (`modules.json`: the Pooling module's config, any
Dense layers, Normalize), never guessed: Qwen3-Embedding pools the last token, others the mean of the tokens, CLS
models the first. A model without those files embeds only with a pooling named explicitly (`pooling=`, serve's
`--pooling`). Texts are embedded in batches, right-padded: a decoder's causal attention keeps each text's real
tokens from seeing the padding after them, so a text's vector does not depend on its batch.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .core.recorder import Recorder
from .errors import InvalidSettingError

POOLINGS = ("mean", "lasttoken", "cls", "max")
LEGACY_POOLINGS = {  # sentence-transformers' older Pooling config: one flag per mode
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}
ACTIVATIONS = {"Identity": lambda x: x, "Tanh": mx.tanh, "GELU": nn.gelu, "ReLU": nn.relu, "Sigmoid": mx.sigmoid}


@dataclass
class Dense:
    """A sentence-transformers Dense module: activation(x @ weight.T + bias)."""

    weight: mx.array
    bias: mx.array | None
    activation: str

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T + (self.bias if self.bias is not None else 0)
        return ACTIVATIONS[self.activation](y)


@dataclass
class Pooling:
    """How token vectors become a text's vector: `mode` (mean, lasttoken, cls, max), then `dense` layers, then
    unit length when `normalize`."""

    mode: str
    dense: list[Dense] = field(default_factory=list)
    normalize: bool = False

    @classmethod
    def named(cls, mode: str, normalize: bool = True) -> "Pooling":
        if mode not in POOLINGS:
            raise InvalidSettingError(f"pooling {mode!r} is none of {', '.join(POOLINGS)}; pick one", "pooling")
        return cls(mode, normalize=normalize)

    @classmethod
    def read(cls, folder: Path) -> "Pooling | None":
        """The pooling a sentence-transformers folder describes (None without a modules.json)."""
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return None
        modules = json.loads(modules_file.read_text())
        mode, dense, normalize = None, [], False
        for module in modules:
            kind, path = module["type"].rsplit(".", 1)[-1], folder / module.get("path", "")
            if kind == "Pooling":
                mode = pooling_mode(json.loads((path / "config.json").read_text()))
            elif kind == "Dense":
                dense.append(dense_layer(path))
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise InvalidSettingError(f"{modules_file} names a {kind} module, which minimlx cannot run")
        if mode is None:
            raise InvalidSettingError(f"{modules_file} names no Pooling module; give the pooling explicitly")
        return cls(mode, dense, normalize)

    def __call__(self, hidden: mx.array, lengths: mx.array) -> mx.array:
        """hidden (texts, tokens, dims) right-padded, lengths (texts,) -> (texts, out dims)."""
        positions = mx.arange(hidden.shape[1])[None, :]
        real = (positions < lengths[:, None])[..., None]
        if self.mode == "mean":
            pooled = (hidden * real).sum(axis=1) / lengths[:, None].astype(hidden.dtype)
        elif self.mode == "max":
            pooled = mx.where(real, hidden, -mx.inf).max(axis=1)
        elif self.mode == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        for layer in self.dense:
            pooled = layer(pooled)
        return pooled


def pooling_mode(config: dict) -> str:
    """The mode a Pooling config names: `pooling_mode` (sentence-transformers 5+) or one legacy flag."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in LEGACY_POOLINGS.items() if config.get(flag)]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else None
    if mode not in POOLINGS:
        raise InvalidSettingError(
            f"the Pooling config {config} asks for {mode!r}; minimlx pools with one of {POOLINGS}"
        )
    return mode


def dense_layer(folder: Path) -> Dense:
    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    mx.eval(weights)  # read now, on this thread's stream: the server computes embeddings on its engine's thread
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    if activation not in ACTIVATIONS:
        raise InvalidSettingError(f"{folder}'s Dense layer uses {activation}, which minimlx does not run")
    return Dense(weights["linear.weight"], weights.get("linear.bias"), activation)


class Embedder:
    """Embeds texts with `model` and `tokenizer` and a `Pooling` (`Embedder.load` reads all three from a folder)."""

    BATCH_TOKENS = 8192  # tokens (rows x longest) in one forward pass

    def __init__(self, model: nn.Module, tokenizer, pooling: Pooling):
        self.model, self.tokenizer, self.pooling = model, tokenizer, pooling

    @classmethod
    def load(cls, path: str | Path, pooling: str | None = None, dtype: str | None = None) -> "Embedder":
        """The folder's model and its sentence-transformers pooling (or the named one, which replaces it)."""
        from .io.resolve import resolve
        from .loading import load

        folder = resolve(path)
        model, tokenizer = load(folder, dtype=dtype)
        found = Pooling.read(folder) if folder.is_dir() else None
        if pooling is not None:
            found = Pooling.named(pooling, normalize=found.normalize if found is not None else True)
        if found is None:
            raise InvalidSettingError(
                f"{path} has no sentence-transformers pooling (modules.json); name one with pooling= "
                f"({', '.join(POOLINGS)})",
                "pooling",
            )
        return cls(model, tokenizer, found)

    def ids(self, texts: list) -> list[list[int]]:
        """Each text's token ids (as the tokenizer adds special tokens); token lists pass as they are."""
        if not texts:
            raise InvalidSettingError("no texts to embed; give at least one", "input")
        return [t if isinstance(t, list) else self.tokenizer.encode(t) for t in texts]

    def __call__(self, texts: list, dimensions: int | None = None) -> np.ndarray:
        """(texts, dims) float32 vectors; `dimensions` keeps the first ones (Matryoshka), renormalized."""
        ids = self.ids(texts)
        if any(not row for row in ids):
            raise InvalidSettingError("a text to embed is empty; give each some text", "input")
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        vectors: list = [None] * len(ids)
        start = 0
        while start < len(order):
            longest, end = len(ids[order[start]]), start
            while end < len(order) and (end - start + 1) * max(longest, len(ids[order[end]])) <= self.BATCH_TOKENS:
                longest = max(longest, len(ids[order[end]]))
                end += 1
            end = max(end, start + 1)
            batch = [ids[i] for i in order[start:end]]
            for i, vector in zip(order[start:end], self.embed_batch(batch)):
                vectors[i] = vector
            start = end
        out = np.stack(vectors)
        if dimensions is not None:
            if not 0 < dimensions <= out.shape[1]:
                raise InvalidSettingError(
                    f"dimensions is {dimensions}, but this model's vectors have {out.shape[1]}", "dimensions"
                )
            out = out[:, :dimensions]
            if self.pooling.normalize:
                out = out / np.linalg.norm(out, axis=1, keepdims=True)
        return out

    def embed_batch(self, batch: list[list[int]]) -> np.ndarray:
        longest = max(len(row) for row in batch)
        padded = mx.array([row + [0] * (longest - len(row)) for row in batch], dtype=mx.int32)
        lengths = mx.array([len(row) for row in batch])
        recorder = Recorder(["final_norm"])
        self.model(padded, recorder=recorder, last_only=True)
        hidden = recorder.values["final_norm"].astype(mx.float32)
        pooled = self.pooling(hidden, lengths)
        if self.pooling.normalize:
            pooled = pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)
        return np.array(pooled)


def embed(model: "str | Path | Embedder", texts: str | list, dimensions: int | None = None, **load) -> np.ndarray:
    """Vectors (texts, dims) of `texts` (one string or a list) by `model`: an Embedder, or a model's path or name
    (loaded with `Embedder.load(model, **load)`: `pooling=`, `dtype=`)."""
    embedder = model if isinstance(model, Embedder) else Embedder.load(model, **load)
    return embedder([texts] if isinstance(texts, str) else list(texts), dimensions)


RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class Reranker:
    """Scores documents against a query as Qwen3-Reranker's model card defines it: the query and a document in its
    prompt, and the probability of "yes" against "no" as the next token."""

    PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

    def __init__(self, model: nn.Module, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        ids = [tokenizer.encode(word, add_special_tokens=False) for word in ("yes", "no")]
        if any(len(word) != 1 for word in ids):
            raise InvalidSettingError("this model's vocabulary has no single 'yes' and 'no' tokens to rerank with")
        self.yes, self.no = ids[0][0], ids[1][0]

    def prompt(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        text = f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        return self.tokenizer.encode(self.PREFIX + text + self.SUFFIX, add_special_tokens=False)

    def __call__(self, query: str, documents: list[str], instruction: str | None = None) -> np.ndarray:
        """(documents,) relevance scores in [0, 1]."""
        return self.scores([self.prompt(query, document, instruction) for document in documents])

    def scores(self, prompts: list[list[int]]) -> np.ndarray:
        """(prompts,) relevance scores of prompts made by `prompt`."""
        scores = []
        for prompt in prompts:
            ids = mx.array([prompt], dtype=mx.int32)
            logits = self.model(ids, last_only=True)[0, -1].astype(mx.float32)
            pair = mx.stack([logits[self.no], logits[self.yes]])
            scores.append(mx.softmax(pair)[1])
        return np.array(mx.stack(scores))


def reranker(model: nn.Module, tokenizer) -> Reranker | None:
    """The model's Reranker, or None when its vocabulary cannot score yes against no."""
    try:
        return Reranker(model, tokenizer)
    except InvalidSettingError:
        return None
