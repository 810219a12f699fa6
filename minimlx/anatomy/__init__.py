"""Taking a model apart: parameter ledger, activation trace, logit lens, residual-stream similarity."""

from .ledger import Ledger, ledger, preset, presets
from .lens import LensResult, layer_distributions, logit_lens
from .similarity import WordComparison, compare_word, embedding_similarity
from .trace import residual_stream, trace

__all__ = [
    "Ledger",
    "LensResult",
    "WordComparison",
    "compare_word",
    "embedding_similarity",
    "layer_distributions",
    "ledger",
    "logit_lens",
    "preset",
    "presets",
    "residual_stream",
    "trace",
]
