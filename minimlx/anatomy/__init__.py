"""Taking a model apart: parameter ledger, activation trace, logit lens, residual-stream similarity."""

from . import lens  # noqa: F401  (minimlx.anatomy.lens.logit_lens once minimlx is imported)
from .ledger import Ledger, ledger, preset, presets
from .similarity import WordComparison, compare_word, embedding_similarity
from .trace import residual_stream, trace

__all__ = [
    "Ledger",
    "WordComparison",
    "compare_word",
    "embedding_similarity",
    "ledger",
    "preset",
    "presets",
    "residual_stream",
    "trace",
]
