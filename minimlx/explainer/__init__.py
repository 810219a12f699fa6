"""The explainer: the walk from tokens to the next token on a page (served, one file, or a notebook cell).

`explain(model, tokenizer, prompt)` computes the walk and returns an `Explanation`, which a notebook shows
(`_repr_html_`) and which writes the standalone page (`save`). `minimlx explain` serves the live page.
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn

from ..anatomy.ablation import Ablation
from ..anatomy.similarity import compare_word
from .figures import ledger_figures, model_info
from .images import ExplainedImage
from .page import fragment, page
from .walk import prompt_ids, prompt_of, walk


@dataclass
class Explanation:
    """The walk (`walk`, as `POST /api/explain` answers it) with what the page shows beside it."""

    title: str
    walk: dict
    info: dict
    ledger: dict
    compare: dict | None = None

    def data(self) -> dict:
        return {"walk": self.walk, "info": self.info, "ledger": self.ledger, "compare": self.compare}

    def _repr_html_(self) -> str:
        return fragment(self.title, self.data())

    def html(self) -> str:
        """The standalone page: one file with its script, style and walk inside, nothing fetched."""
        return page(self.title, self.data())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.html(), encoding="utf-8")


def explain(
    model: nn.Module,
    tokenizer,
    prompt: str,
    chat_template: bool = False,
    ablate: Ablation | None = None,
    compare: tuple[str, str, str] | None = None,
    title: str = "model",
    image=None,
) -> Explanation:
    """The walk of `prompt` (as a user message in the chat template when `chat_template`) under `ablate`; with
    `compare` = (first, second, word), the word's drift between two contexts beside it; with `image` (a path, bytes
    or a Pillow image, for an image-text model), the picture before the prompt's text, unless the text writes the
    image's start token itself, and the image panel (the picture, its grids, attention to it)."""
    picture = ExplainedImage.read(model, tokenizer, image) if image is not None else None
    ids, note = prompt_of(prompt_ids(tokenizer, prompt, chat_template, picture), picture)
    result = {**walk(model, tokenizer, ids, ablate, picture), "note": note}
    drift = compare_word(model, tokenizer, *compare).to_dict() if compare else None
    return Explanation(title, result, model_info(model, tokenizer, title), ledger_figures(model), drift)


__all__ = ["Explanation", "explain"]
