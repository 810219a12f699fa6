"""Checks shared by the native kernel's tests: a program run under each instruction set the kernel can be capped at
(MINIMLX_NATIVE_ISA), the integer products' greedy decoding against the float path's, and the compiled step with each
block as one `block_step` against the same step with every part as its own op."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx


def per_instruction_set(program: str, isas: dict[str, str], folder: Path, *args: str) -> dict[str, dict]:
    """isa -> the arrays `program` saved to its first argument, run in a fresh process under each cap of `isas` (cap ->
    the name the kernel gives the instruction set it runs, which `program` prints last), with `args` after that
    argument; only the caps this CPU runs as named (a narrower one runs for the others). "scalar" always runs."""
    results = {}
    for isa, name in isas.items():
        path = folder / f"{isa}.npz"
        env = dict(os.environ, MINIMLX_NATIVE_ISA=isa)
        done = subprocess.run(
            [sys.executable, "-c", program, str(path), *args], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        if done.stdout.split()[-1] == name:
            results[isa] = mx.load(str(path))
    assert "scalar" in results
    return results


def integer_against_float(model, prompt: mx.array, steps: int, monkeypatch) -> tuple[int, float]:
    """Greedy decoding of `model` from `prompt` with float32 inputs to the products, teacher-forcing the same tokens
    through a second cache with the integer products: (steps whose greedy ids agree, largest logit difference)."""
    from minimlx.core.steps import decode_steps
    from minimlx.cpu import native

    caches = {exact: model.make_cache() for exact in (True, False)}

    def step(ids, exact):
        monkeypatch.setattr(native, "exact_products", exact)
        with decode_steps():
            return model(ids, caches[exact], last_only=True)[0, -1]

    logits = {exact: model(prompt, caches[exact], last_only=True)[0, -1] for exact in (True, False)}  # float32 both
    agree, largest = 0, 0.0
    for _ in range(steps):
        token = mx.argmax(logits[True]).item()
        agree += mx.argmax(logits[False]).item() == token
        largest = max(largest, mx.abs(logits[False] - logits[True]).max().item())
        logits = {exact: step(mx.array([[token]]), exact) for exact in (True, False)}
    return agree, largest


def fused_and_alone(model, prompt: mx.array, steps: int, monkeypatch, cache_of=lambda cache: cache) -> tuple:
    """Greedy logits of the compiled step from `prompt` over `steps` tokens with each block as one `block_step` and
    with every part as its own op (caches made by `cache_of` from the decoder's), and how many times `block_step` was
    called: (fused logits, alone logits, calls while fused, calls in all)."""
    from minimlx.core.steps import decode_steps
    from minimlx.cpu import forms, native
    from minimlx.decode.compiled import CompiledDecoder

    calls = []
    block_step, real_step_plan = native.kernel.block_step, forms.step_plan
    monkeypatch.setattr(native.kernel, "block_step", lambda *a, **k: calls.append(1) or block_step(*a, **k))

    def run(fused: bool) -> list[mx.array]:
        monkeypatch.setattr(forms, "step_plan", real_step_plan if fused else lambda _: None)
        decoder = CompiledDecoder(model)
        cache = [cache_of(c) for c in decoder.make_cache()]
        logits = [decoder(prompt, cache, last_only=True)[0, -1]]
        with decode_steps():
            for _ in range(steps):
                logits.append(decoder(mx.argmax(logits[-1]).reshape(1, 1), cache)[0, -1])
                mx.eval(logits[-1])
        return logits

    fused = run(True)
    fused_calls = len(calls)
    return fused, run(False), fused_calls, len(calls)
