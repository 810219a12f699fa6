"""Expert tensors as checkpoints store them -> the stacked `(num_experts, out, in)` weights of core's `Experts`.

A checkpoint layout, so it lives with the plugins that read it (Mixtral, Qwen-MoE, DeepSeek), not in core.
"""

import re

import mlx.core as mx

PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|scales|biases)$")
FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint expert tensors -> the stacked `experts.{gate,up,down}_proj.weight` of `Experts`.

    Accepts per-expert tensors `...experts.{e}.{proj}.weight` (what published checkpoints hold; quantized ones with
    their `scales` and `biases`), and the fused `...experts.gate_up_proj` (num_experts, 2 * hidden, dims) and
    `...experts.down_proj` (num_experts, dims, hidden) that transformers 5 keeps in memory.
    """
    out, per_expert = {}, {}
    for name, w in weights.items():
        if m := PER_EXPERT.match(name):
            per_expert.setdefault(f"{m[1]}.{m[3]}.{m[4]}", {})[int(m[2])] = w
        elif m := FUSED.match(name):
            if m[2] == "gate_up_proj":
                out[f"{m[1]}.gate_proj.weight"], out[f"{m[1]}.up_proj.weight"] = mx.split(w, 2, axis=1)
            else:
                out[f"{m[1]}.down_proj.weight"] = w
        else:
            out[name] = w
    for name, experts in per_expert.items():
        out[name] = mx.stack([experts[e] for e in sorted(experts)])
    return out
