"""minimlx at two git revisions side by side, on SmolLM2-135M: did a change (a refactor) cost speed?

    python benchmarks/before_after.py BEFORE [AFTER] [--rounds 3] [--clients 1 8] [--tokens 64]

Each revision is checked out in a worktree of its own (the working tree's native kernel, `minimlx_native`, serves
both: a revision that changed native/ is compared with the one built here). Rounds interleave the revisions: each
round runs `minimlx bench smollm2-135m` (prefill of 128 tokens, decode of 64) in a fresh process of each, then a
burst of N concurrent streaming completions (benchmarks/serve.py's) against a `minimlx serve` of each, for every N
in --clients. The table gives the medians over rounds and the ratio AFTER / BEFORE.
"""

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve as serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = re.compile(r"prefill ([\d.]+) tok/s .* decode ([\d.]+) tok/s")


@contextlib.contextmanager
def checkout(revision: str, work: Path):
    """A worktree of `revision` whose imports find its own minimlx and the native kernel built here."""
    folder = work / re.sub(r"\W+", "-", revision)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), revision], check=True)
    try:
        kernel = next((ROOT / "native" / "src" / "minimlx_native").glob("_ext*.so"), None)
        if kernel is not None:
            (folder / "native" / "src" / "minimlx_native" / kernel.name).symlink_to(kernel)
        yield {"PYTHONPATH": f"{folder}{os.pathsep}{folder / 'native' / 'src'}"}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], check=False)


def bench(env: dict) -> tuple[float, float]:
    """(prefill, decode) tok/s of one `minimlx bench` run."""
    command = [sys.executable, "-m", "minimlx", "bench", "smollm2-135m", "--repeats", "1"]
    out = subprocess.run(command, env=os.environ | env, capture_output=True, text=True, check=True).stdout
    found = BENCH.search(out)
    return float(found.group(1)), float(found.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if args.rounds < 1 or args.tokens < 1 or min(args.clients) < 1:
        parser.error("--rounds, --tokens and every --clients count must be at least 1")
    names = {"before": args.before, "after": args.after}
    figures = {name: {} for name in names}
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        envs = {name: stack.enter_context(checkout(revision, Path(work))) for name, revision in names.items()}
        servers = {}
        for name, env in envs.items():
            port = serving.free_port()
            command = [sys.executable, "-m", "minimlx", "serve", "--port", str(port), "--max-batch", "16"]
            server = serving.Server(command, env, port, "smollm2-135m")
            stack.enter_context(serving.start(server, Path(work) / f"{name}.log"))
            serving.stream_completion(server.url, server.model, serving.prompt_text(128, seed="warm-up"), 8)
            servers[name] = server
        for round_ in range(args.rounds):
            for name in names:
                prefill, decode = bench(envs[name])
                figures[name].setdefault("prefill tok/s", []).append(prefill)
                figures[name].setdefault("decode tok/s", []).append(decode)
                for n in args.clients:
                    prompts = [serving.prompt_text(128, seed=f"{round_}-{n}-{i}") for i in range(n)]
                    result = serving.burst(servers[name], prompts, args.tokens)
                    figures[name].setdefault(f"serve {n} clients tok/s", []).append(result["tps"])
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in figures["after"].items()))
    print(f"\n| measure | {args.before} | {args.after} | ratio |\n| --- | ---: | ---: | ---: |")
    for measure in figures["before"]:
        before, after = (statistics.median(figures[name][measure]) for name in names)
        print(f"| {measure} | {before:.1f} | {after:.1f} | {after / before:.3f}x |")


if __name__ == "__main__":
    main()
