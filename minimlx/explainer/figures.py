"""What the page shows beside the walk: the model's shape, and the ledger panel's figures (parameters by
component, total and active, and the seed's depth table)."""

from dataclasses import asdict

import mlx.nn as nn

from ..anatomy.depth import depth_rows
from ..anatomy.ledger import ledger
from ..tune.lora import adapters
from .walk import INLINE_ATTENTION, MAX_TOKENS


def ledger_figures(model: nn.Module) -> dict:
    """The loaded model's ledger (components, total, active, shape) and the seed's ten models beside it."""
    rows = [{**asdict(row), "layers_per_128": row.layers_per_128} for row in depth_rows()]
    return {"ledger": ledger(model).to_dict(), "depth": rows}


def model_info(model: nn.Module, tokenizer, name: str, second_name: str | None = None) -> dict:
    """What the page needs before the first walk: the model's name and shape and what it can do."""
    experts = [getattr(layer.ffn, "num_experts", 0) for layer in model.layers]
    return {
        "model": name,
        "layers": len(model.layers),
        "heads": [layer.attn.heads if layer.attn.attends else 0 for layer in model.layers],  # 0: a recurrent layer
        "experts": experts,
        "chat_template": tokenizer.chat_template is not None,
        "max_tokens": MAX_TOKENS,
        "inline_attention": INLINE_ATTENTION,
        "second": second_name,
        "adapted": bool(adapters(model)),  # the walk then carries the base against the adapted model
    }
