"""GGUF vocabularies under every `tokenizer.ggml.pre` llama.cpp reads: splits and ids as transformers and llama.cpp
give them.

The files carry SmolLM2's real 49,152-token vocabulary and merges under another pre-tokenizer name. Where llama.cpp
and transformers read a name differently, minimlx follows llama.cpp, which wrote the file.
"""

import mlx.core as mx
import pytest
from corpus import CORPUS
from models import smollm2_gguf
from reference import require

from minimlx.errors import UnsupportedArchitectureError
from minimlx.text import Tokenizer
from minimlx.text.byte_level import BYTE_CHARS, token_bytes
from minimlx.text.gguf_vocab import GPT2, PRE_TOKENIZER_SPLITS, read_vocab

# transformers' own table (integrations/gguf/gguf_tokenizer_mapping.py); it splits every other name like GPT-2
TRANSFORMERS_NAMES = [
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "dbrx",
    "smaug-bpe",
    "tekken",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "qwen35",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
]
GPT2_NAMES = [pre for pre, splits in PRE_TOKENIZER_SPLITS.items() if splits == (GPT2,)]
BYTES = list(BYTE_CHARS.values())  # a vocabulary of single bytes: enough to see how text is split


@pytest.fixture(scope="module")
def smollm2():
    return mx.load(str(smollm2_gguf()), return_metadata=True)[1]


def write_vocab(path, metadata: dict, pre: str):
    """A GGUF holding only a tokenizer: SmolLM2's vocabulary, plus "12" and "123" to show how digits are grouped."""
    gguf = require("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(metadata["tokenizer.ggml.tokens"] + ["12", "123"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"] + ["1 2", "12 3"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"].tolist() + [1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def pieces(pre: str, text: str) -> list[str]:
    """The text of each piece `pre` splits `text` into before BPE."""
    vocab = read_vocab(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": BYTES,
            "tokenizer.ggml.merges": [],
        }
    )
    return [token_bytes(piece).decode() for piece, _ in vocab.backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"])
def test_gguf_ids_match_transformers(tmp_path, smollm2, pre):
    """One file for each split transformers knows. `tokenizer_type` spares it parsing the whole file for a model
    config (10 s here); the tokenizer it builds is the same."""
    transformers = require("transformers")
    path = write_vocab(tmp_path / "vocab.gguf", smollm2, pre)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, tokenizer_type="gpt2")
    ours = Tokenizer.from_gguf(mx.load(str(path), return_metadata=True)[1])
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("pre", TRANSFORMERS_NAMES + GPT2_NAMES)
def test_every_name_transformers_reads_splits_as_there(pre):
    require("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    reference, _ = convert_gguf_tokenizer(
        "llama", {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": BYTES, "merges": []}
    )
    for text in CORPUS:
        theirs = [token_bytes(piece).decode() for piece, _ in reference.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces(pre, text) == theirs, text


@pytest.mark.parametrize(
    "pre, text, split",
    [
        ("smollm", "4123", ["4", "1", "2", "3"]),
        ("gpt-2", "4123", ["4123"]),
        ("llama-bpe", "4123", ["412", "3"]),
        ("tiny_aya", "1234567", ["1", "234", "567"]),
        ("superbpe", "1234567 is", ["1", "234", "567", " is"]),
        ("falcon", "a+=1234", ["a", "+=", "123", "4"]),
        ("deepseek-llm", "Hello 世界123\n", ["Hello", " ", "世界", "123", "\n"]),
        ("kimi-k2", "中文and 中", ["中文", "and", " ", "中"]),
        ("bloom", "Hello, world!", ["Hello", ",", " world", "!"]),
        ("jais-2", "a       b", ["a", "    ", "  ", " b"]),
        ("exaone-moe", "New York City", ["New York City"]),
        # llama.cpp reads case-aware regexes with "a letter other than a-z" for an upper-case letter
        # (transformers: "ÉCOLE", " a", "Éb"), and youtu's as any run of letters (transformers: "Hello", "World")
        ("tekken", "ÉCOLE aÉb", ["É", "COLE", " aÉb"]),
        ("youtu", "HelloWorld 한국어", ["HelloWorld", " ", "한국어"]),
    ],
)
def test_splits_as_llama_cpp(pre, text, split):
    """Checked against llama.cpp's own tokenizer on these files; transformers splits all but the first three like
    GPT-2, or differently (the last two)."""
    assert pieces(pre, text) == split


def test_every_name_builds_and_round_trips():
    for pre in PRE_TOKENIZER_SPLITS:
        tokenizer = Tokenizer.from_gguf(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.tokens": BYTES,
                "tokenizer.ggml.merges": [],
            }
        )
        for text in CORPUS:
            assert tokenizer.decode(tokenizer.encode(text)) == text, (pre, text)


@pytest.mark.slow
def test_whole_tokens_first_where_llama_cpp_looks_them_up(smollm2):
    """llama.cpp's `ignore_merges`: a pre-token the vocabulary holds is one token even when no merge builds it."""
    vocab = {
        **smollm2,
        "tokenizer.ggml.tokens": smollm2["tokenizer.ggml.tokens"] + ["ĠHelloWorld"],
        "tokenizer.ggml.token_type": smollm2["tokenizer.ggml.token_type"].tolist() + [1],
    }
    whole = len(smollm2["tokenizer.ggml.tokens"])
    assert Tokenizer.from_gguf({**vocab, "tokenizer.ggml.pre": "llama-bpe"}).encode(" HelloWorld") == [whole]
    assert whole not in Tokenizer.from_gguf({**vocab, "tokenizer.ggml.pre": "qwen2"}).encode(" HelloWorld")


def test_unknown_name_says_which_are_known():
    with pytest.raises(UnsupportedArchitectureError, match=r"pre-tokenizer 'gpt2' is not supported \(known: .*gpt-2"):
        vocab = {"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []}
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", **vocab})


def spm_vocab(scores: list[float]) -> dict:
    """A SentencePiece vocabulary of "a", "b", "ab" and "ba" with these scores, no space prefix."""
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "a", "b", "ab", "ba"],
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 1, 1, 1, 1],
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": False,
    }


def test_equal_scores_join_the_leftmost_pair_as_llama_cpp_does():
    """llama-vocab.cpp's `llm_bigram_spm` order: the higher score first, the leftmost pair among equal ones. With "ab"
    and "ba" scored alike no order of BPE merges gives both "aba" = ab|a and "bab" = ba|b; a lower "ab" gives way.
    (These are llama-tokenize's ids for the two vocabularies.)"""
    tied = Tokenizer.from_gguf(spm_vocab([0.0, 0.0, 0.0, -1000.0, -1000.0]))
    assert [tied.encode(text) for text in ("aba", "bab", "abab")] == [[3, 1], [4, 2], [3, 3]]
    assert [tied.backend.encode(text).ids for text in ("aba", "bab")] != [[3, 1], [4, 2]]  # merges ranked by score
    ranked = Tokenizer.from_gguf(spm_vocab([0.0, -1.0, -2.0, -4.0, -3.0]))
    assert ranked.encoder is ranked.backend  # distinct scores: BPE merges give llama.cpp's ids
    assert [ranked.encode(text) for text in ("aba", "bab", "abab")] == [[1, 4], [4, 2], [1, 4, 2]]


@pytest.mark.parametrize(
    "metadata, missing",
    [
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}, "tokenizer.ggml.scores"),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"]}, "tokenizer.ggml.tokens"),
    ],
)
def test_a_vocabulary_missing_its_merges_or_tokens_is_one_line(metadata, missing):
    from minimlx.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"has no {missing};"):
        read_vocab(metadata)
