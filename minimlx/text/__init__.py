"""Text: tokenizers (from tokenizer.json or GGUF metadata), chat templates, streaming detokenization."""

from .tokenizer import Tokenizer

__all__ = ["Tokenizer"]
