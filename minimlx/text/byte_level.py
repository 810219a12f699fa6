"""GPT-2's byte alphabet: byte-level BPE spells every byte as one printable character."""

import re


def byte_chars() -> dict[int, str]:
    """byte -> the character that spells it: printable Latin-1 bytes stand for themselves, the rest move past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {byte: chr(byte) for byte in printable} | {byte: chr(256 + i) for i, byte in enumerate(others)}


BYTE_CHARS = byte_chars()
CHAR_BYTES = {char: byte for byte, char in BYTE_CHARS.items()}
_TO_LATIN1 = str.maketrans({char: chr(byte) for char, byte in CHAR_BYTES.items()})
_OUTSIDE_ALPHABET = re.compile("[^" + re.escape("".join(CHAR_BYTES)) + "]")


def spell(text: str) -> str:
    """`text`'s UTF-8 bytes in the byte alphabet (how a vocabulary entry like "<think>" looks to byte-level BPE)."""
    return "".join(BYTE_CHARS[byte] for byte in text.encode("utf-8"))


def token_bytes(token: str) -> bytes:
    """The bytes a token stands for, as the `ByteLevel` decoder reads it: raw UTF-8 if spelled outside the alphabet."""
    if _OUTSIDE_ALPHABET.search(token):
        return token.encode("utf-8")
    return token.translate(_TO_LATIN1).encode("latin-1")
