"""A `tokenizers.Tokenizer` rebuilt from the vocabulary a GGUF file carries in its metadata.

A GGUF has no `tokenizer.json`: it stores the tokens, merges, token types and special ids under llama.cpp's
key names, and names the pre-tokenizer (`tokenizer.ggml.pre`) its converter recognised. The result gives the
ids llama.cpp gives: the pre-tokenizer splits are the regexes `llama-vocab.cpp` runs for each name, which are
those of the model's own tokenizer.json except where llama.cpp's regex engine reads them differently.
"""

import heapq
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import CheckpointError, UnsupportedArchitectureError
from .byte_level import CHAR_BYTES, spell

# The regexes of llama-vocab.cpp's `llm_tokenizer_bpe`, as written there unless a comment says otherwise.
# llama.cpp's engine has no inline flags, so `(?i:'s|'t|...)` is spelled out, and no letter case: `\p{Lu}` or
# `\p{Ll}` match any letter (unicode.cpp collapses every letter to one class), which is why the case-aware
# regexes read "a letter other than a-z". (GPT2 lacks tokenizer.json's final `|\s+`: no split differs without it.)
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
JAIS2 = (
    CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)"
    r"|\s{1,2}(?!\S)|\s{1}"
)
MINICPM5 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SEED_CODER = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
EXAONE_MOE = (
    CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# llama.cpp's stand-ins for tekken's upper- and lower-case letters: a letter other than a-z, other than A-Z
UPPER, LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GRANITE_EMBED = GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])")
# youtu's and tiny_aya's case-aware letter runs, which llama.cpp matches as any run of letters and marks
LETTERS_AND_MARKS = rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+{CONTRACTIONS}?"
TINY_AYA = LETTERS_AND_MARKS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
YOUTU = LETTERS_AND_MARKS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
YOUTU_CJK = r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+"
# kimi-k2 and afmoe run hand-written splitters in unicode.cpp (tiny_aya's digits too); these regexes do the same.
HAN = r"\x{3400}-\x{4DBF}\x{4E00}-\x{9FFF}\x{F900}-\x{FAFF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2EBEF}\x{2F800}-\x{2FA1F}"
KIMI_K2 = (
    rf"[{HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{HAN}]]+{CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGITS_IN_THREES_FROM_THE_RIGHT = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
WORDS = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
DEEPSEEK3 = WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPARK2_5 = WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
CJK = r"[一-龥぀-ゟ゠-ヿ]+"
AFMOE_CJK = r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+"
DEEPSEEK_CJK = r"[一-龥ࠀ-一가-퟿]+"
# \x{...}: characters that Unicode normalization would change (ώ, ι, ΐ, Ί, Ω, K), so this file keeps them
DEEPSEEK_LETTERS = (
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿ"
    r"ᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\x{1F7D}ᾀ-ᾴᾶ-ᾼ\x{1FBE}ῂ-ῄῆ-ῌῐ-\x{1FD3}ῖ-\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼ"
    r"ℂℇℊ-ℓℕℙ-ℝℤ\x{2126}ℨ\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"
)
NOT_PUNCTUATION = r" ?[^(\s|.,!?…。，、।۔،)]+"

# Names of Llama 3's split whose vocabularies hold pre-tokens whole (see IGNORE_MERGES); dbrx, smaug-bpe and
# chatglm-bpe split the same way but do not.
LLAMA3_NAMES = ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"]
LLAMA3_NAMES += ["jina-v5-nano", "glm4", "glm5"]
# `tokenizer.ggml.pre` -> the regexes that split text before BPE, applied one after the other: every name
# llama.cpp reads for a byte-level BPE vocabulary. Not here: gemma4, granite-embed-multi-311m and sarvam-moe
# (BPE over raw UTF-8 with "▁" for spaces, not bytes) and whitespace (another tokenizer model).
# "default" (and no name: files older than the key) splits like GPT-2, as the llama.cpp that wrote those files
# did and as transformers reads it; llama.cpp today splits such files with a fallback it warns degrades them.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        [
            "default",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "roberta-bpe",
            "jina-es",
            "jina-de",
            "jina-v1-en",
            "jina-v2-es",
            "jina-v2-de",
            "jina-v2-code",
        ],
        (GPT2,),
    ),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"], (r"\p{N}", GPT2)
    ),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"),
    **dict.fromkeys([*LLAMA3_NAMES, "dbrx", "smaug-bpe", "chatglm-bpe"], (LLAMA3,)),
    "jais-2": (JAIS2,),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"],
        (QWEN2,),
    ),
    "qwen35": (QWEN35,),
    "laguna": (r"[^\n]+|[\n]+", QWEN2),
    "ufakzeka": (UFAKZEKA,),
    "seed-coder": (SEED_CODER,),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], (BAILINGMOE,)),
    "exaone-moe": (EXAONE_MOE,),
    "minicpm5": (r"\p{N}{1,3}", MINICPM5),
    "deepseek-llm": (r"[\r\n]", DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", DEEPSEEK_CJK, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], (r"\p{N}{1,3}", CJK, DEEPSEEK3)),
    "spark2_5": (r"\p{N}{1,3}", CJK, SPARK2_5, r"\p{N}"),
    "afmoe": (DIGITS_IN_THREES_FROM_THE_RIGHT, AFMOE_CJK, DEEPSEEK3),
    "youtu": (YOUTU_CJK, YOUTU),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], (DIGITS_IN_THREES_FROM_THE_RIGHT, TINY_AYA)),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], (NOT_PUNCTUATION,)),
    "viking": (NOT_PUNCTUATION, r"\p{N}"),
    "tekken": (TEKKEN,),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        GPT2,
    ),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], (GPT4O,)),
    "granite-embed-multi-97m": (GRANITE_EMBED,),
    "kimi-k2": (KIMI_K2,),
    "superbpe": (r"\p{N}+", "(?=([0-9]{3})+(?![0-9]))"),  # std::regex's \d is ASCII
}
# llama.cpp emits a pre-token the vocabulary holds whole before trying merges (`ignore_merges`, as in Llama 3's
# tokenizer.json): for these names, a token the merges cannot build is still found.
IGNORE_MERGES = {
    *LLAMA3_NAMES,
    "youtu",
    "tekken",
    "minicpm5",
    "granite-embed-multi-97m",
}

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


@dataclass
class GGUFVocab:
    backend: Tokenizer  # what a tokenizer.json can hold
    bos_token: str | None
    eos_token: str | None
    end_token_ids: set[int]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    encoder: Tokenizer = field(default=None)  # `backend`, or one that encodes as llama.cpp where `backend` cannot

    def __post_init__(self):
        self.encoder = self.encoder or self.backend


def read_vocab(metadata: dict) -> GGUFVocab:
    """What a `minimlx.text.Tokenizer` needs from GGUF metadata (as `mx.load(..., return_metadata=True)` gives it)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in READERS:
        raise UnsupportedArchitectureError(
            f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE, 'llama' SentencePiece and "
            "'gemma4' BPE); use the model's Hugging Face folder with tokenizer.json instead"
        )
    needed = ["tokenizer.ggml.tokens", "tokenizer.ggml.scores" if model == "llama" else "tokenizer.ggml.merges"]
    if model == "llama" and "tokenizer.ggml.merges" in metadata:
        needed.pop()
    missing = [key for key in needed if key not in metadata]
    if missing:
        raise CheckpointError(
            f"the GGUF's {model} vocabulary has no {' or '.join(missing)}; the file is incomplete: convert the model "
            "again with llama.cpp's convert_hf_to_gguf.py, or load its Hugging Face folder"
        )
    backend = READERS[model](metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    kinds = _list(metadata.get("tokenizer.ggml.token_type", []))
    # Control tokens are never split; user-defined ones (like "<think>") are matched whole too, but not special.
    # Only tokens the vocabulary spells as given: a control token outside the byte alphabet is a converter mislabel.
    known = [
        (token, kind)
        for token, kind in zip(tokens, kinds)
        if kind in (CONTROL, USER_DEFINED) and backend.token_to_id(token) is not None
    ]
    rstrip = rstripped(metadata)
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True, rstrip=token in rstrip)
            for token, kind in known
            if kind == CONTROL
        ]
    )
    backend.add_tokens(
        [AddedToken(token, normalized=False, special=False) for token, kind in known if kind == USER_DEFINED]
    )
    named = {
        name: tokens[_scalar(metadata[f"tokenizer.ggml.{name}_token_id"])]
        for name in ("bos", "eos", "unknown", "padding")
        if f"tokenizer.ggml.{name}_token_id" in metadata
    }
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in named.values() if token not in added]
    )
    return GGUFVocab(
        backend=backend,
        encoder=sentencepiece_encoder(backend, metadata) if model == "llama" else None,
        bos_token=named.get("bos"),
        eos_token=named.get("eos"),
        end_token_ids={
            _scalar(metadata[f"tokenizer.ggml.{name}_token_id"])
            for name in ("eos", "eot", "eom")
            if f"tokenizer.ggml.{name}_token_id" in metadata
        },
        add_bos_token=bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token", model == "llama"))),
        add_eos_token=bool(_scalar(metadata.get("tokenizer.ggml.add_eos_token", False))),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def rstripped(metadata: dict) -> set[str]:
    """The control tokens that swallow the whitespace after them: llama.cpp gives Phi-3's (files whose general.name
    says phi3 or phi-3) that attribute, all but <unk>, <s> and <|endoftext|>."""
    name = str(metadata.get("general.name", "")).lower()
    if "phi3" not in name and "phi-3" not in name:
        return set()
    tokens, kinds = metadata["tokenizer.ggml.tokens"], _list(metadata.get("tokenizer.ggml.token_type", []))
    return {token for token, kind in zip(tokens, kinds) if kind == CONTROL} - {"<unk>", "<s>", "<|endoftext|>"}


def byte_level_bpe(metadata: dict) -> Tokenizer:
    """GPT-2-style BPE over bytes, split first by the regexes `tokenizer.ggml.pre` names."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedArchitectureError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}); "
            "use the model's Hugging Face folder with tokenizer.json instead"
        )
    spelled = {
        token if all(char in CHAR_BYTES for char in token) else spell(token): i
        for i, token in enumerate(metadata["tokenizer.ggml.tokens"])
    }
    backend = Tokenizer(
        models.BPE(
            spelled,
            _merges(metadata),
            continuing_subword_prefix="",
            end_of_word_suffix="",
            ignore_merges=pre in IGNORE_MERGES,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_bpe(metadata: dict) -> Tokenizer:
    """SentencePiece BPE (model "llama"): "▁" for spaces, `<0xNN>` byte fallback, merges ranked by token score.

    `tokenizer.ggml.add_space_prefix` (true unless the file says otherwise; Gemma's say false) puts a "▁" before the
    text and after each special or user-defined token, always, as llama.cpp does (even before a space); decoding takes
    the first one off again. Spaces are kept as they are (llama.cpp ignores SentencePiece's
    `remove_extra_whitespaces`), and the text is not split: merges may cross spaces."""
    space_prefix = bool(_scalar(metadata.get("tokenizer.ggml.add_space_prefix", True)))
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = _merges(metadata)
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, _list(metadata["tokenizer.ggml.scores"]))))
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁")] * space_prefix + [normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(content=" ", left=1)] * space_prefix
    )
    return backend


def gemma4_bpe(metadata: dict) -> Tokenizer:
    """Gemma 4's BPE (model "gemma4"): SentencePiece's spelling ("▁" for spaces, `<0xNN>` byte fallback, no space
    prefix) merged by the file's merges over raw UTF-8, the text split only into runs of newlines and runs of the
    rest, each run that is a token taken whole, as llama.cpp does."""
    vocab = {token: i for i, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    merges = [
        (merge[: merge.find(" ", 1)], merge[merge.find(" ", 1) + 1 :]) for merge in metadata["tokenizer.ggml.merges"]
    ]
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, ignore_merges=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


READERS = {"gpt2": byte_level_bpe, "llama": sentencepiece_bpe, "gemma4": gemma4_bpe}  # tokenizer.ggml.model's


def sentencepiece_encoder(backend: Tokenizer, metadata: dict) -> Tokenizer | None:
    """`backend` with llama.cpp's own merging (`SentencePieceMerging`) when tokens that pairs join share scores
    (Gemma's and tokenizer.json-converted files are mostly one placeholder): llama.cpp joins the leftmost of
    equal-scoring pairs, which no order of BPE merges can say (with tokens "ab" and "ba" alike, "aba" is ab|a and
    "bab" ba|b). None otherwise, where merges ranked by score give llama.cpp's ids."""
    tokens, scores = metadata["tokenizer.ggml.tokens"], _list(metadata["tokenizer.ggml.scores"])
    vocab = {token: i for i, token in enumerate(tokens)}

    def part(text: str) -> bool:  # llama.cpp starts from characters, tokens or not
        return len(text) == 1 or text in vocab

    joined = [
        score
        for token, score in zip(tokens, scores)
        if any(part(token[:cut]) and part(token[cut:]) for cut in range(1, len(token)))
    ]
    if len(set(joined)) == len(joined):
        return None
    encoder = Tokenizer.from_str(backend.to_str())
    encoder.model = models.BPE(vocab, [], ignore_merges=True, byte_fallback=True)
    encoder.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(SentencePieceMerging(dict(zip(tokens, scores))))
    return encoder


class SentencePieceMerging:
    """llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`) as a pre-tokenizer: starting from the characters,
    join the adjacent pair whose text is the best-scoring token, the leftmost among equal scores, until no pair's text
    is a token. Each piece is then a token, or a character that byte fallback spells."""

    def __init__(self, scores: dict[str, float]):
        self.scores = scores

    def pre_tokenize(self, pretok) -> None:
        pretok.split(lambda _, text: [text[start:end] for start, end in self.spans(str(text))])

    def spans(self, text: str) -> list[tuple[int, int]]:
        """The (start, end) of each piece of `text`."""
        ends = list(range(1, len(text) + 1))  # piece i is text[i:ends[i]]; a joined-away piece has ends[i] == i
        before = list(range(-1, len(text) - 1))
        queue = []

        def offer(left: int, right: int) -> None:
            if left >= 0 and right < len(text) and (score := self.scores.get(text[left : ends[right]])) is not None:
                heapq.heappush(queue, (-score, left, right, ends[right]))

        for i in range(1, len(text)):
            offer(i - 1, i)
        while queue:
            _, left, right, end = heapq.heappop(queue)
            if ends[left] != right or ends[right] != end:  # either side changed since the pair was offered
                continue
            ends[left], ends[right] = end, right
            if end < len(text):
                before[end] = left
            offer(before[left], left)
            offer(left, end)
        spans, start = [], 0
        while start < len(text):
            spans.append((start, ends[start]))
            start = ends[start]
        return spans


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; higher-scoring results merge first, as in SentencePiece."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted(
            (pair for pair in pairs if pair[0] in vocab and pair[1] in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
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
