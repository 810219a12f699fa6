"""A packed model's KV cache in float16 (the default on the CPU's native kernel) against float32, all else equal.

    python benchmarks/half_cache.py [--model smollm2-135m] [--prompt-tokens 128,4096] [--gen-tokens 64] [--rounds 3]

One process, one engine, the model loaded once; each round runs every prompt length with the cache in float16 and
then in float32 (`cpu.forms.halves_cache` switched), so a busy machine slows both alike. Printed: medians over the
rounds of prefill and decode tokens/s and the cache's bytes, and decode's float16 / float32 ratio.
"""

import argparse
import random
import statistics

from minimlx import load  # first: its BLAS must be loaded before mlx.core  # isort: skip

from minimlx.cli.bench import timed_generation
from minimlx.cpu import forms
from minimlx.decode.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", default="128,4096")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    engine = Engine(model, max_batch=1)
    halves = forms.halves_cache
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    prompts = {n: [random.Random(n).randrange(tokenizer.vocab_size) for _ in range(n)] for n in lengths}
    runs = {(n, half): [] for n in lengths for half in (True, False)}
    timed_generation(engine, prompts[lengths[0]], 4)
    for _ in range(args.rounds):
        for n in lengths:
            for half in (True, False):
                forms.halves_cache = halves if half else lambda *_: False
                first, rest, generation = timed_generation(engine, prompts[n], args.gen_tokens)
                cache_bytes = sum(c.nbytes for c in generation.cache)
                runs[n, half].append((n / first, (args.gen_tokens - 1) / rest, cache_bytes))
    forms.halves_cache = halves
    print(f"{args.model}, {args.gen_tokens} greedy tokens after random prompts, medians of {args.rounds} rounds\n")
    print("| prompt tokens | KV cache | prefill tok/s | decode tok/s | float16 / float32 decode | cache bytes |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n in lengths:
        for half in (True, False):
            rows = runs[n, half]
            ratios = [h[1] / f[1] for h, f in zip(runs[n, True], runs[n, False])]
            ratio = f"{statistics.median(ratios):.2f}x" if half else ""
            prefill, decode, nbytes = (statistics.median(r[i] for r in rows) for i in range(3))
            kind = "float16" if half else "float32"
            print(f"| {n} | {kind} | {prefill:.1f} | {decode:.1f} | {ratio} | {nbytes / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
