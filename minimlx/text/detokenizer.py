"""Streaming detokenization: text out as token ids come in, never half a UTF-8 character.

Byte-level BPE and SentencePiece decoders turn each token into fixed bytes, so streaming is a table lookup
plus an incremental UTF-8 decoder that holds back an unfinished character: constant work per token. Any other
decoder gets `RedecodingDetokenizer`, which is correct for every decoder but re-decodes the whole sequence.
"""

import codecs
import json
import re

from tokenizers import Tokenizer as Backend

from .byte_level import token_bytes

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ByteDetokenizer:
    """Looks up each token's bytes and emits the characters they complete."""

    def __init__(self, table: list[bytes], strip_first_space: bool):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_first_space = strip_first_space
        self._started = False

    def add(self, token_id: int) -> str:
        data = self._table[token_id] if token_id < len(self._table) else b""
        if data and not self._started:
            self._started = True
            if self._strip_first_space and data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def finalize(self) -> str:
        return self._utf8.decode(b"", final=True)


class RedecodingDetokenizer:
    """Re-decodes all ids so far and emits what grew, once it no longer ends in an unfinished character."""

    def __init__(self, backend: Backend, skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._backend.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def finalize(self) -> str:
        return self._take(self._backend.decode(self._ids, skip_special_tokens=self._skip))

    def _take(self, text: str) -> str:
        new, self._emitted = text[self._emitted :], len(text)
        return new


def byte_table(backend: Backend, skip_special_tokens: bool) -> tuple[list[bytes], bool] | None:
    """Each id's bytes and whether the decoder drops the text's first space, or None for decoders this cannot model."""
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder else {}
    if decoder.get("type") == "ByteLevel":
        to_bytes, strip_first_space = token_bytes, False
    elif spm_steps := _sentencepiece_steps(decoder):
        byte_fallback, strip_first_space = "ByteFallback" in spm_steps, "Strip" in spm_steps

        def to_bytes(token: str) -> bytes:
            if byte_fallback and (byte := BYTE_TOKEN.fullmatch(token)):
                return bytes([int(byte.group(1), 16)])
            return token.replace("▁", " ").encode("utf-8")
    else:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        table[token_id] = to_bytes(token)
    if skip_special_tokens:
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.special:
                table[token_id] = b""
    return table, strip_first_space


def _sentencepiece_steps(decoder: dict) -> set[str]:
    """The steps of a SentencePiece decoder (Replace "▁" -> " ", ByteFallback, Fuse, Strip a leading space), or none."""
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    spm = {
        "Replace": lambda step: step["pattern"] == {"String": "▁"} and step["content"] == " ",
        "ByteFallback": lambda step: True,
        "Fuse": lambda step: True,
        "Strip": lambda step: (step["content"], step["start"], step["stop"]) == (" ", 1, 0),
    }
    understood = all(step["type"] in spm and spm[step["type"]](step) for step in steps)
    types = [step["type"] for step in steps]
    strips_text = "Strip" not in types or types[-2:] == ["Fuse", "Strip"]  # after Fuse, Strip acts on the whole text
    return set(types) if understood and "Replace" in types and strips_text else set()
