#!/usr/bin/env bash
# What a new user gets: fresh virtual environments made only with the README's first command, each in a fresh
# checkout of this tree (tracked files, uncommitted edits included), decoding side by side with this machine's own
# install of minimlx and its native kernel (its python3, running the same checkout's minimlx).
#   kernel       the README's first command here, where a C++ compiler builds the native kernel
#   no compiler  the same with CXX=/bin/false, as on a machine without a C++ compiler
# Usage: bash benchmarks/fresh_install.sh [ROUNDS [BENCH_OPTIONS...]]
#   ROUNDS (default 5) interleaved rounds of `minimlx bench smollm2-135m --json BENCH_OPTIONS` per install; the
#   table shows their medians (and bests: the least disturbed runs on a busy host) and the ratios of decode speeds
#   to this machine's install. Everything made is removed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-5}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
system_python="$(command -v python3)"
snapshot="$(git -C "$repo" stash create)"
snapshot="${snapshot:-$(git -C "$repo" rev-parse HEAD)}"  # fixed now: the tree may change while this runs
readme_command="$(awk '/^```bash$/ {getline; print; exit}' "$repo/README.md")"
echo "the README's first command: $readme_command"

fresh() {  # NAME [VARIABLE=VALUE...]: a checkout in $work/NAME and its .venv, made with the README's first command
  local name=$1 start=$SECONDS
  shift
  mkdir "$work/$name"
  git -C "$repo" archive "$snapshot" | tar -x -C "$work/$name"
  python3 -m venv "$work/$name/.venv"
  (cd "$work/$name" && source .venv/bin/activate && env "$@" bash -c "$readme_command" >"$work/$name.log" 2>&1) ||
    { tail -n 30 "$work/$name.log"; exit 1; }
  echo "$name: the README's first command took $((SECONDS - start)) s; minimlx's stderr:"
  grep "^note:\|^warning:" "$work/$name.log" || echo "(nothing)"
}

bench() {  # NAME PYTHON: one `minimlx bench` run, appended to $work/NAME.jsonl (its notes were shown above)
  "$2" -m minimlx bench smollm2-135m --json "${@:3}" >>"$work/$1.jsonl" 2> >(grep -v "^note:" >&2)
}

fresh kernel
fresh no-compiler CXX=/bin/false
for round in $(seq "$rounds"); do
  PYTHONPATH="$work/kernel" bench system "$system_python" "${@:2}"
  for name in kernel no-compiler; do
    bench "$name" "$work/$name/.venv/bin/python" "${@:2}"
  done
done
"$system_python" - "$work" "$rounds" <<'EOF'
import json
import statistics
import sys

work, rounds = sys.argv[1], sys.argv[2]
rows = {
    "this machine's install": "system",
    "fresh venv, README's first command": "kernel",
    "the same without a C++ compiler": "no-compiler",
}
runs = {name: [json.loads(line) for line in open(f"{work}/{name}.jsonl")] for name in rows.values()}
decode = {name: [run["decode_tps"] for run in runs[name]] for name in runs}
median, best = ({name: f(decode[name]) for name in runs} for f in (statistics.median, max))
print(f"\nsmollm2-135m, medians (and bests) of {rounds} interleaved rounds\n")
print("| install | weights run as | prefill tok/s | decode tok/s | decode vs this machine's install |")
print("| --- | --- | ---: | ---: | ---: |")
for label, name in rows.items():
    prefill = statistics.median(run["prefill_tps"] for run in runs[name])
    ratios = f"{median[name] / median['system']:.2f}x ({best[name] / best['system']:.2f}x)"
    print(f"| {label} | {runs[name][0]['dtype']} | {prefill:.1f} | {median[name]:.1f} ({best[name]:.1f}) | {ratios} |")
EOF
