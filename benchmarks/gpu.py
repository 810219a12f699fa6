"""minimlx against mlx-lm on one MLX backend and the same 4-bit weights: prefill, decode and a batch, one table.

    python benchmarks/gpu.py [--rounds 3] [--prompt-tokens 512] [--gen-tokens 128] [--batch 8] [--work DIR]

Made for a GPU (Apple silicon's Metal, or NVIDIA's CUDA with `pip install "mlx[cuda13]"`); both run on MLX's default
device, whatever it is (the table names it), so on a CPU-only machine it compares them on MLX's CPU backend, where
minimlx runs its own native kernel. The weights: SmolLM2-135M's Q4_1 GGUF written once by `minimlx convert` to an
MLX folder (4-bit groups of 32 and the 8-bit embedding, packed as shipped), which both load as it is. Each
measurement is a process of its own (this script with --worker), rounds interleaved, medians:

- prefill: tokens/s of a random --prompt-tokens prompt, to its first answer token;
- decode: tokens/s of the --gen-tokens after it (greedy, end-of-text not stopping either);
- batch: the aggregate tokens/s of --batch random 128-token prompts answered together, --gen-tokens each at most
  (each stops at its end-of-text; the count is of the tokens generated).
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare import ENVIRONMENT, machine, prompt_ids, smollm2_gguf, timed  # noqa: E402

RUNNERS = ("minimlx", "mlx-lm")


def minimlx_worker(folder: str, prompt_tokens: int, gen_tokens: int, batch: int) -> dict:
    import minimlx
    from minimlx.decode import Engine, Request, SamplingSettings

    model, tokenizer = minimlx.load(folder)

    def tokens(ids, count):
        engine = Engine(model, tokenizer, max_batch=1)
        generation = engine.submit(Request(ids, SamplingSettings(count), stop_ids=frozenset()))
        while engine.busy:
            yield from (output.token for output in engine.step() if output.generation is generation)

    def answer(prompts):
        engine = Engine(model, tokenizer, max_batch=len(prompts))
        generations = [engine.submit(Request(ids, SamplingSettings(gen_tokens))) for ids in prompts]
        engine.run()
        return sum(len(g.tokens) - (g.finish_reason == "stop") for g in generations)  # as mlx-lm counts: no end id

    return measure(tokens, answer, prompt_tokens, gen_tokens, batch)


def mlx_lm_worker(folder: str, prompt_tokens: int, gen_tokens: int, batch: int) -> dict:
    import mlx.core as mx
    from mlx_lm import batch_generate, load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(folder)

    def tokens(ids, count):
        return (token for token, _ in generate_step(mx.array(ids), model, max_tokens=count))

    def answer(prompts):
        response = batch_generate(model, tokenizer, prompts, max_tokens=gen_tokens, return_token_ids=True)
        return sum(len(ids) for ids in response.token_ids)

    return measure(tokens, answer, prompt_tokens, gen_tokens, batch)


def measure(tokens, answer, prompt_tokens: int, gen_tokens: int, batch: int) -> dict:
    """One warm-up of each shape, then one measured run of each."""
    import mlx.core as mx

    prompt, prompts = prompt_ids(prompt_tokens, 0), [prompt_ids(128, seed) for seed in range(1, batch + 1)]
    timed(tokens(prompt, 4), 4)
    answer(prompts[:2])
    first, rest = timed(tokens(prompt, gen_tokens), gen_tokens)
    start = time.perf_counter()
    generated = answer(prompts)
    return {
        "device": str(mx.default_device()),
        "prefill": prompt_tokens / first,
        "decode": (gen_tokens - 1) / rest,
        "batch": generated / (time.perf_counter() - start),
    }


def converted(work: Path) -> Path:
    """SmolLM2-135M's GGUF as an MLX folder, written once."""
    folder = work / "smollm2-135m-mlx"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-m", "minimlx", "convert", "smollm2-135m", str(folder)], check=True)
    return folder


def at_least(least: int):
    """An argparse type: a whole number of at least `least`."""

    def whole(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
        return int(text)

    return whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--prompt-tokens", type=at_least(1), default=512)
    parser.add_argument("--gen-tokens", type=at_least(2), default=128, help="decode is timed after the first")
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "minimlx-bench")
    parser.add_argument("--worker", choices=RUNNERS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.prompt_tokens, args.gen_tokens, args.batch)
    if args.worker:
        worker = minimlx_worker if args.worker == "minimlx" else mlx_lm_worker
        print(json.dumps(worker(args.folder, *shape)))
        return
    if importlib.util.find_spec("mlx_lm") is None:
        sys.exit("mlx-lm is not installed: pip install mlx-lm")
    smollm2_gguf()  # exits with the fix when SmolLM2 is not installed
    folder = converted(args.work)
    results = {name: [] for name in RUNNERS}
    for round_ in range(1, args.rounds + 1):
        for name in RUNNERS:
            command = [sys.executable, __file__, "--worker", name, "--folder", str(folder)]
            command += ["--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
            command += ["--batch", str(args.batch)]
            done = subprocess.run(command, env=ENVIRONMENT, capture_output=True, text=True, check=True)
            results[name].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"round {round_} {name}: {results[name][-1]}", file=sys.stderr)
    device = results["minimlx"][0]["device"]
    print(f"\n{machine()}; MLX's default device: {device}\n")
    print(
        f"SmolLM2-135M, the GGUF's 4-bit weights as one MLX folder; prefill of {args.prompt_tokens} tokens, "
        f"{args.gen_tokens} decoded after it, a batch of {args.batch} 128-token prompts; medians of {args.rounds} "
        "interleaved rounds, each run in its own process\n"
    )
    print("| tok/s | minimlx | mlx-lm | minimlx / mlx-lm |")
    print("| --- | ---: | ---: | ---: |")
    for key, label in (("prefill", "prefill"), ("decode", "decode"), ("batch", f"batch of {args.batch}, aggregate")):
        ours, theirs = (statistics.median(r[key] for r in results[name]) for name in RUNNERS)
        print(f"| {label} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
