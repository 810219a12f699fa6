"""PEFT adapter folders for the tests, written by PEFT itself on the transformers model of a tiny random checkpoint:
its LoRA (or DoRA) matrices seeded random (PEFT starts B at zero, which would change nothing)."""

import copy
from pathlib import Path

from reference import require


def peft_adapter(
    torch_model, folder: Path, seed: int, targets=("q_proj", "v_proj", "down_proj"), rank=4, alpha=8, dora=False
) -> Path:
    """A PEFT adapter of `torch_model` (left as it is) saved to `folder`: rank `rank`, lora_alpha `alpha` on the
    Hugging Face projections `targets`, its matrices random (seed `seed`)."""
    torch, peft = require("torch"), require("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_dora=dora)
    adapted = peft.get_peft_model(copy.deepcopy(torch_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                noise = torch.randn(p.shape, generator=generator) * 0.3
                p.copy_(p + noise if "magnitude" in name else noise)
    adapted.save_pretrained(folder)
    return folder
