"""GGUF vocabularies tokenized as llama.cpp's own `llama-tokenize` does, id for id.

Every vocabulary type the built-in families' GGUF files use: SmolLM2's byte-level BPE (a real 49,152-token
vocabulary), the K-quant fixtures' small GPT-2 one, and SentencePiece ones that llama.cpp's converter wrote from
tiny models trained at test time: Gemma's (no space prefix, `add_space_prefix` false) and Phi-3's, which is Llama 2's
and Mistral's kind (a space prefix), and Gemma's again with every score one placeholder (what llama.cpp's converter
writes for a vocabulary it reads from tokenizer.json; llama.cpp then joins the leftmost of equal-scoring pairs). Each
text is tokenized with and without the BOS the file asks for, special tokens embedded in it parsed as llama.cpp
parses them.

llama.cpp's ids come from tests/fixtures/llama_tokenize_ids.json: building `llama-tokenize` takes minutes, too long
for every CI run. `MINIMLX_LLAMA_TOKENIZE=1 python -m pytest tests/test_text_gguf_tokenize.py` builds it (once, into the
test cache), asks it again and rewrites the file. Each vocabulary's entry keeps a fingerprint of its tokens, so a
vocabulary that came out differently (a converter or trainer that changed) fails as such, not as wrong ids.
"""

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from corpus import CORPUS
from llamacpp import llama_tokenize, llamacpp_tool
from models import smollm2_gguf

from minimlx.errors import UnsupportedArchitectureError
from minimlx.text import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
IDS = FIXTURES / "llama_tokenize_ids.json"
ASK_LLAMA_CPP = os.environ.get("MINIMLX_LLAMA_TOKENIZE") == "1"
MORE = [
    " leading space",
    "  two leading spaces and trailing two  ",
    "\n\nnewlines first\n",
    "tabs\tand\t\ttabs",
    "digits 0 00 000 0000 3.5e-10 ١٢٣",
    "Привет, мир! Γειά σου κόσμε. 안녕하세요 세계 مرحبا بالعالم",
    "    indented code():\n        return {'a': [1, 2]}",
    "",
    " ",
]
# name -> the file under the converted fixtures' folder (None: SmolLM2's; "kquant": kquant_llama.py's Q6_K file)
VOCABS = {
    "smollm2": None,
    "kquant-gpt2": "kquant",
    "gemma": "gemma2-f32.gguf",
    "gemma-placeholder-scores": "gemma2-f32.gguf",  # rewritten by placeholder_scores
    "phi3": "phi3-f32.gguf",
    "glm4": "glm4-f32.gguf",
}


@pytest.fixture(scope="module")
def recorded():
    """llama-tokenize's ids by vocabulary; with MINIMLX_LLAMA_TOKENIZE=1, asked anew and written back at the end."""
    known = json.loads(IDS.read_text()) if IDS.is_file() else {}
    yield known
    if ASK_LLAMA_CPP:
        IDS.write_text(json.dumps(known, separators=(",", ":"), sort_keys=True) + "\n")


def placeholder_scores(path: Path, out: Path) -> Path:
    """The vocabulary of the GGUF `path` (no tensors) with every score -1000, the placeholder llama.cpp's converter
    writes for a vocabulary it reads from tokenizer.json."""
    import gguf

    writer = gguf.GGUFWriter(str(out), "llama")
    for name, value in gguf.GGUFReader(str(path)).fields.items():
        if name.startswith("tokenizer."):
            contents = [-1000.0] * len(value.contents()) if name == "tokenizer.ggml.scores" else value.contents()
            writer.add_key_value(name, contents, value.types[0], sub_type=value.types[-1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request, converted, kquant_llama, recorded, tmp_path_factory):
    file = VOCABS[request.param]
    path = smollm2_gguf() if file is None else kquant_llama["Q6_K"] if file == "kquant" else converted / file
    if request.param == "gemma-placeholder-scores":
        path = placeholder_scores(path, tmp_path_factory.mktemp("placeholder") / "vocab.gguf")
    metadata = mx.load(str(path), return_metadata=True)[1]
    tokenizer = Tokenizer.from_gguf(metadata)
    fingerprint = hashlib.sha256("\n".join(metadata["tokenizer.ggml.tokens"]).encode()).hexdigest()[:16]
    if ASK_LLAMA_CPP:
        llamacpp_tool("llama-tokenize")
        texts = texts_for(tokenizer)
        ids = {bos: llama_tokenize(path, texts, bos) for bos in (True, False)}
        recorded[request.param] = {"tokens": fingerprint, "with_bos": ids[True], "without": ids[False]}
    entry = recorded.get(request.param)
    if entry is None:
        pytest.fail(f"{IDS.name} has no ids for {request.param}: run with MINIMLX_LLAMA_TOKENIZE=1")
    assert entry["tokens"] == fingerprint, f"{request.param}'s vocabulary changed: rerun with MINIMLX_LLAMA_TOKENIZE=1"
    return entry, tokenizer


def texts_for(tokenizer: Tokenizer) -> list[str]:
    """The corpus, plus its vocabulary's own special tokens embedded in text, at the start and after spaces."""
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    embedded = [f"{bos}Hello{eos} world", f"a {eos} b", f"{eos}\n{bos} x {eos}", f"text{bos}{bos}  {eos}"]
    return [*CORPUS, *MORE, *embedded]


@pytest.mark.slow
@pytest.mark.parametrize("add_bos", [True, False], ids=["with_bos", "without"])
def test_ids_match_llama_tokenize(vocab, add_bos):
    entry, tokenizer = vocab
    texts = texts_for(tokenizer)
    expected = entry["with_bos" if add_bos else "without"]
    assert len(expected) == len(texts), "the corpus changed: rerun with MINIMLX_LLAMA_TOKENIZE=1"
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text, add_special_tokens=add_bos) == ids, text


@pytest.mark.slow
def test_decode_inverts_encode(vocab):
    _, tokenizer = vocab
    for text in [*CORPUS, *MORE]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text, text


def test_unigram_vocabularies_are_refused_in_one_line():
    with pytest.raises(UnsupportedArchitectureError, match=r"GGUF tokenizer model 't5' is not supported") as error:
        Tokenizer.from_gguf({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    assert "\n" not in str(error.value)
