"""Decode after a long prompt with the KV cache as the model holds it by default (float16 for packed weights on the
CPU's native kernel, else the model's dtype), in 8 and in 4 bits: one table of tokens/s and cache bytes.

    python benchmarks/kv_cache.py [--model smollm2-135m] [--prompt-tokens 4096] [--gen-tokens 32] [--rounds 3]

Each configuration is `minimlx bench --json` in a fresh process (one warm-up, one measured run); rounds interleave
the configurations so that a busy machine slows all of them alike, and the table shows medians over rounds, and
each configuration's decode rate over the default's (the compiled step, what `minimlx run` decodes with) in every
round.
"""

import argparse
import json
import statistics
import subprocess
import sys

CONFIGS = {
    "default": [],
    "default, eager": ["--eager"],
    "8-bit": ["--kv-bits", "8"],
    "4-bit": ["--kv-bits", "4"],
}


def bench(model: str, prompt_tokens: int, gen_tokens: int, options: list[str]) -> dict:
    command = [sys.executable, "-m", "minimlx", "bench", model, "--json", "--repeats", "1"]
    command += ["--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens), *options]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_ in range(args.rounds):
        for name, options in CONFIGS.items():
            results[name].append(bench(args.model, args.prompt_tokens, args.gen_tokens, options))
            print(f"round {round_ + 1}: {name}: {results[name][-1]['decode_tps']:.1f} tok/s", file=sys.stderr)
    default_bytes = statistics.median(r["kv_cache_gb"] for r in results["default"])
    print(
        f"{args.model}, decode after {args.prompt_tokens} prompt tokens, median of {args.rounds} interleaved rounds\n"
    )
    print("| KV cache | decode tok/s | vs default (per-round ratios) | prefill tok/s | cache bytes | vs default |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        ratios = [r["decode_tps"] / f["decode_tps"] for r, f in zip(runs, results["default"])]
        cache = statistics.median(r["kv_cache_gb"] for r in runs)
        print(
            f"| {name} | {statistics.median(r['decode_tps'] for r in runs):.1f} | {statistics.median(ratios):.2f}x "
            f"| {statistics.median(r['prefill_tps'] for r in runs):.1f} | {cache * 1e3:.1f} MB "
            f"| {cache / default_bytes:.3f}x |"
        )


if __name__ == "__main__":
    main()
