"""How long the explainer's walk (`POST /api/explain`'s work) takes on SmolLM2: `python benchmarks/explain_walk.py`.

A 32-token prompt, float32 (as `minimlx explain` computes), best of five after one warm-up; then the same for a
prompt of MAX_TOKENS tokens, the most a walk reads.
"""

import time

import minimlx
from minimlx.explainer.walk import MAX_TOKENS, walk


def best(model, tokenizer, ids, runs: int = 5) -> float:
    walk(model, tokenizer, ids)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        walk(model, tokenizer, ids)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    model, tokenizer = minimlx.load("smollm2-135m", dtype="float32")
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 40
    for tokens in (32, MAX_TOKENS):
        ids = tokenizer.encode(text)[:tokens]
        print(f"walk of {tokens} tokens: {best(model, tokenizer, ids):.2f} s")


if __name__ == "__main__":
    main()
