"""Fine-tuning: low-rank adapters (LoRA, DoRA) as forms of linear maps, their files, and what a training step computes.

    from minimlx import load
    from minimlx.tune import AdapterSettings, attach, differentiable, masked_loss, adamw, save_adapter, load_adapter

    model, tokenizer = load("smollm2-135m")          # packed weights stay packed: QLoRA is LoRA on a packed model
    differentiable(model)                           # CPU forms back to MLX's ops (the native kernel has no gradients)
    paths = attach(model, AdapterSettings(rank=8, alpha=16, targets=("q_proj", "v_proj")))  # or "all-linear", dora=True
    # a mixture's routed experts too: experts=("gate_up_proj", "down_proj") (PEFT's target_parameters)
    optimizer = adamw(1e-4, iters=1000, warmup=100)  # AdamW (torch's), linear warm-up then cosine decay
    step = nn.value_and_grad(model, lambda m, ids, mask: masked_loss(m, ids, mask)[0])
    loss, grads = step(model, ids, mask)            # ids (batch, tokens); mask 1 where token t's loss counts
    optimizer.update(model, grads); mx.eval(model.trainable_parameters(), optimizer.state)
    save_adapter(model, "out", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")   # PEFT's files
    load_adapter(other_model, "out")                # PEFT's or mlx-lm's folders

- `lora`: `AdapterSettings`; `LoRALinear` / `DoRALinear` (wrap `.base`; `lora_a` (rank, in), `lora_b` (out, rank),
  DoRA's `magnitude` (out,); `delta()` = scale B A, `fused_weight()` the adapted float weight); `attach` (returns the
  wrapped module paths), `wrap` (given paths), `adapters` (path -> form), `detached` (the base in the adapted
  model's place, within a `with` block), `adapter_weights` (`<path>.lora_a`, ...),
  `fused_weights` (`<path>.weight`, for fusing), `checkpoint_name` (a module path's Hugging Face name);
  `LoRAExperts` (routed experts with per-expert adapters of their stacked projections, PEFT's `ParamWrapper`) and
  `expert_adapters` (path -> it).
- `formats`: `save_adapter` (PEFT), `read_adapter` -> `Adapter` (settings, tensors under model names, base model,
  source) without touching the model, `load_adapter` (read, wrap, install), `install`.
- `train`: `masked_loss(model, ids, mask) -> (loss, tokens)`, `schedule`, `adamw`, `differentiable`.
"""

from .formats import Adapter, load_adapter, read_adapter, save_adapter
from .lora import (
    AdapterSettings,
    DoRALinear,
    LoRAExperts,
    LoRALinear,
    adapter_weights,
    adapters,
    attach,
    checkpoint_name,
    detached,
    expert_adapters,
    fused_weights,
    wrap,
)
from .train import adamw, differentiable, masked_loss, schedule

__all__ = [
    "Adapter",
    "AdapterSettings",
    "DoRALinear",
    "LoRAExperts",
    "LoRALinear",
    "adamw",
    "adapter_weights",
    "adapters",
    "attach",
    "checkpoint_name",
    "detached",
    "differentiable",
    "expert_adapters",
    "fused_weights",
    "load_adapter",
    "masked_loss",
    "read_adapter",
    "save_adapter",
    "schedule",
    "wrap",
]
