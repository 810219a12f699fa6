"""A `tokenizers.Tokenizer` rebuilt from the vocabulary a GGUF file carries in its metadata.

A GGUF has no `tokenizer.json`: it stores the tokens, merges, token types and special ids under llama.cpp's
key names, and names the pre-tokenizer (`tokenizer.ggml.pre`) its converter recognised. The result gives the
ids transformers' GGUF tokenizer gives; the pre-tokenizer splits follow llama.cpp (`llama-vocab.cpp`).
"""

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from ..errors import UnsupportedArchitectureError
from .byte_level import CHAR_BYTES, spell

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SINGLE_DIGITS = r"\p{N}"

# `tokenizer.ggml.pre` -> the regexes that split text before BPE, applied one after the other.
# "default" (files older than the key) splits like GPT-2, as transformers reads it.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["default", "gpt2", "mpt", "olmo", "jais"], (GPT2_SPLIT,)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], (SINGLE_DIGITS, GPT2_SPLIT)
    ),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"], (LLAMA3_SPLIT,)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], (QWEN2_SPLIT,)),
}

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


@dataclass
class GGUFVocab:
    backend: Tokenizer
    bos_token: str | None
    eos_token: str | None
    end_token_ids: set[int]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def read_vocab(metadata: dict) -> GGUFVocab:
    """What a `minimlx.text.Tokenizer` needs from GGUF metadata (as `mx.load(..., return_metadata=True)` gives it)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedArchitectureError(
            f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE and 'llama' "
            "SentencePiece); use the model's Hugging Face folder with tokenizer.json instead"
        )
    backend = byte_level_bpe(metadata) if model == "gpt2" else sentencepiece_bpe(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    kinds = _list(metadata.get("tokenizer.ggml.token_type", []))
    # Control tokens are never split; user-defined ones (like "<think>") are matched whole too, but not special.
    # Only tokens the vocabulary spells as given: a control token outside the byte alphabet is a converter mislabel.
    known = [(token, kind) for token, kind in zip(tokens, kinds) if kind in (CONTROL, USER_DEFINED)
             and backend.token_to_id(token) is not None]
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in known if kind == CONTROL])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in known if kind == USER_DEFINED])
    named = {name: tokens[_scalar(metadata[f"tokenizer.ggml.{name}_token_id"])]
             for name in ("bos", "eos", "unknown", "padding") if f"tokenizer.ggml.{name}_token_id" in metadata}
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token in named.values() if token not in added])
    return GGUFVocab(
        backend=backend,
        bos_token=named.get("bos"),
        eos_token=named.get("eos"),
        end_token_ids={_scalar(metadata[f"tokenizer.ggml.{name}_token_id"])
                       for name in ("eos", "eot", "eom") if f"tokenizer.ggml.{name}_token_id" in metadata},
        add_bos_token=bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", model == "llama"))),
        add_eos_token=bool(_scalar(metadata.get("tokenizer.ggml.add_eos_token", False))),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def byte_level_bpe(metadata: dict) -> Tokenizer:
    """GPT-2-style BPE over bytes, split first by the regexes `tokenizer.ggml.pre` names."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedArchitectureError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}); "
            "use the model's Hugging Face folder with tokenizer.json instead"
        )
    spelled = {token if all(char in CHAR_BYTES for char in token) else spell(token): i
               for i, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    backend = Tokenizer(models.BPE(spelled, _merges(metadata), continuing_subword_prefix="", end_of_word_suffix=""))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(metadata: dict) -> Tokenizer:
    """SentencePiece BPE (model "llama"): "▁" for spaces, `<0xNN>` byte fallback, merges ranked by token score."""
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = _merges(metadata)
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, _list(metadata["tokenizer.ggml.scores"]))))
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; higher-scoring results merge first, as in SentencePiece."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted((pair for pair in pairs if pair[0] in vocab and pair[1] in vocab),
                       key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _merges(metadata: dict) -> list[tuple[str, str]]:
    return [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]


def _scalar(value):
    """A metadata number as Python: `mx.load` gives 0-d arrays, the `gguf` reader plain values."""
    return value.item() if hasattr(value, "item") else value


def _list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)
