"""Decode speed of the CPU's decode-step paths side by side: integer products (the default) against float32 inputs
(`--exact`), at a short and a long context, with the float and the 8-bit KV cache; optionally against another build
of the native kernel (`--baseline-kernel DIR`, a folder holding a `minimlx_native` built from another commit, put
first on PYTHONPATH) under the same Python code.

    python benchmarks/decode_paths.py --rounds 3 [--baseline-kernel /tmp/old_build]

Each configuration is `minimlx bench MODEL --gen-tokens 64 --repeats 1 --json` in its own process, the rounds
interleaved; the table gives medians and each round's figure.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def configurations(baseline: str | None) -> dict[str, tuple[list[str], dict]]:
    found = {
        "128-token prompt, default": (["--prompt-tokens", "128"], {}),
        "128-token prompt, `--exact`": (["--prompt-tokens", "128", "--exact"], {}),
        "4,096-token prompt, default": (["--prompt-tokens", "4096"], {}),
        "4,096-token prompt, `--exact`": (["--prompt-tokens", "4096", "--exact"], {}),
        "4,096-token prompt, `--kv-bits 8`": (["--prompt-tokens", "4096", "--kv-bits", "8"], {}),
    }
    if baseline:
        found["4,096-token prompt, default, baseline kernel"] = (["--prompt-tokens", "4096"], {"PYTHONPATH": baseline})
        found["4,096-token prompt, `--kv-bits 8`, baseline kernel"] = (
            ["--prompt-tokens", "4096", "--kv-bits", "8"],
            {"PYTHONPATH": baseline},
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-kernel", metavar="DIR")
    args = parser.parse_args()
    runs = configurations(args.baseline_kernel)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    bench = [sys.executable, "-m", "minimlx", "bench", args.model, "--gen-tokens", "64", "--repeats", "1", "--json"]
    for round_ in range(args.rounds):
        load = os.getloadavg()[0]
        for name, (options, env) in runs.items():
            done = subprocess.run(bench + options, capture_output=True, text=True, env={**os.environ, **env})
            if done.returncode != 0:
                print(f"round {round_ + 1} {name}: failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(result)
            print(f"round {round_ + 1} (load {load:.1f}) {name}: {result['decode_tps']:.1f} tok/s", file=sys.stderr)
    print("| configuration | decode tok/s | rounds | prefill tok/s |")
    print("| --- | ---: | --- | ---: |")
    for name, measured in results.items():
        if measured:
            decode = [r["decode_tps"] for r in measured]
            prefill = statistics.median(r["prefill_tps"] for r in measured)
            rounds = ", ".join(f"{d:.1f}" for d in decode)
            print(f"| {name} | {statistics.median(decode):.1f} | {rounds} | {prefill:.1f} |")


if __name__ == "__main__":
    main()
