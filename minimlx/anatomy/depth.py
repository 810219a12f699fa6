"""The seed's depth table: how wide and how deep ten 2024-2025 models are, counted from their presets.

The seed articles end on a table of ten models (width, depth, total and active parameters) to show
that newer models go deeper at the same width and that mixtures of experts spend the compute they
save on depth. Every figure here is read off a shipped preset (the published `config.json`) through
the ledger; none is typed in.
"""

from dataclasses import dataclass
from functools import cache

from .ledger import ledger

SEED_MODELS = {  # the seed table's names, in its order (by depth), and the preset each is counted from
    "LLaMA-3-8B": "llama3-8b",
    "Qwen3-8B": "qwen3-8b",
    "gpt-oss-120b": "gpt-oss-120b",
    "GLM-4-9B": "glm-4-9b",
    "Gemma-3-12B": "gemma-3-12b",
    "DeepSeek-V3": "deepseek-v3",
    "Kimi K2": "kimi-k2",
    "Gemma-3-27B": "gemma-3-27b",
    "Qwen3-32B": "qwen3-32b",
    "Qwen3-235B-A22B": "qwen3-235b-a22b",
}


@dataclass(frozen=True)
class DepthRow:
    """One model of the table: parameters (total and active per token), width, depth and query heads."""

    model: str
    preset: str
    params: int
    active: int
    width: int
    layers: int
    heads: int

    @property
    def layers_per_128(self) -> float:
        """Layers per 128 of width: the seed's rule of thumb puts 8B models near 1 (4096 / 128 = 32 layers)."""
        return self.layers * 128 / self.width


@cache
def depth_rows() -> tuple[DepthRow, ...]:
    """The seed's ten models, counted from their presets, in the seed's order: once per process (the presets ship
    with the package; every page of the explainer shows them)."""
    rows = []
    for model, name in SEED_MODELS.items():
        entry = ledger(name)
        shape = entry.shape
        rows.append(DepthRow(model, name, entry.total, entry.active, shape["d_model"], shape["layers"], shape["heads"]))
    return tuple(rows)


def _count(params: int) -> str:
    return f"{params / 1e12:.2f}T" if params >= 1e12 else f"{params / 1e9:.2f}B"


def depth_table(rows: tuple[DepthRow, ...]) -> str:
    """The rows as the seed prints them, plus heads and layers per 128 of width."""
    lines = [
        f"{'model':<17}{'preset':<17}{'params':>9}{'active':>9}{'width':>7}{'layers':>8}{'heads':>7}"
        f"{'layers/128 width':>18}"
    ]
    for row in rows:
        lines.append(
            f"{row.model:<17}{row.preset:<17}{_count(row.params):>9}{_count(row.active):>9}{row.width:>7}"
            f"{row.layers:>8}{row.heads:>7}{row.layers_per_128:>18.2f}"
        )
    return "\n".join(lines)
