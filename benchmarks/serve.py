"""Concurrent streaming chat requests against minimlx serve and its peers, SmolLM2-135M, same weights.

    python benchmarks/serve.py [--clients 1 4 8 16] [--tokens 64] [--rounds 3] [--work DIR] [--json-schema]

Each server starts in its own process on a free port and answers one warm-up request; then, for each
N in --clients, N clients each send one streaming chat request at the same moment (temperature 0,
`max_tokens` --tokens, each a different question that asks for a long answer) and read it to the end.
Aggregate tokens/s = generated tokens of all N / seconds from the sends to the last token; time to
first token (TTFT) is the median over the N requests of the seconds to their first content delta.
Each server goes through the client counts --rounds times in turn, and the table gives the medians of
the rounds (a busy machine slows one burst, not all of them), failed requests summed over the rounds.

--json-schema also sends every minimlx burst with `response_format` set to a JSON schema (a story object:
a title, a story of at least 400 characters so that the answer runs to --tokens as the unconstrained one does,
tags), burst for burst beside the unconstrained one, and reports the ratio of the two: what computing a
grammar's token mask at every step costs a batch.

Servers, each left out with a note when not installed: minimlx serve --dtype float32 (the GGUF dequantized),
minimlx serve as it starts by default with the native kernel of native/ installed (the GGUF's Q4_1 weights kept
packed, through the kernel), mlx-lm's
server (`python -m mlx_lm server`, the GGUF's weights dequantized to float32 by transformers, the BLAS
minimlx loads preloaded so that both multiply with the same library, on one thread as minimlx serve
does) and llama-cpp-python's server
(the GGUF as shipped). Peers are benchmarks only, never minimlx dependencies.
"""

import argparse
import http.client
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare import ENVIRONMENT, float32_folder, machine, smollm2_gguf  # noqa: E402

TOPICS = [
    "a dragon",
    "the sea",
    "a robot",
    "a city at night",
    "a lost key",
    "the moon",
    "a small bakery",
    "a mountain climb",
    "an old library",
    "a train journey",
    "a chess game",
    "a garden",
    "a storm",
    "a lighthouse",
    "a desert",
    "a violin",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], env: dict, port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(command, env=ENVIRONMENT | env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    sys.exit(f"{command[:4]} did not start; see {log}")


STORY = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "minLength": 400},  # so that both kinds of answer run to --tokens
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["title", "story", "tags"],
    "additionalProperties": False,
}


def stream_chat(
    url: str, model: str, topic: str, tokens: int, schema: dict | None = None
) -> tuple[float | None, int, bool]:
    """(seconds to the first content delta, generated tokens, whether it failed) of one streaming request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, first, deltas, usage = time.perf_counter(), None, 0, None
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = first or time.perf_counter() - start
                    deltas += 1
    except (OSError, http.client.HTTPException):  # refused, reset or cut short: a failed request
        return first, deltas, True
    return first, (usage or {}).get("completion_tokens", deltas), False


def burst(url: str, model: str, clients: int, tokens: int, schema: dict | None = None) -> tuple[float, float, int]:
    """(aggregate generated tokens/s, median time to first token, failed requests) of `clients` requests at once."""
    results, go = [None] * clients, threading.Barrier(clients + 1)

    def client(i):
        go.wait()
        results[i] = stream_chat(url, model, TOPICS[i % len(TOPICS)], tokens, schema)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    first = [r[0] for r in results if r[0] is not None]
    ttft = statistics.median(first) if first else float("nan")
    return sum(r[1] for r in results) / wall, ttft, sum(r[2] for r in results)


MINIMLX, MINIMLX_KERNEL = "minimlx serve --dtype float32", "minimlx serve (default: Q4_1 on the native kernel)"


def servers(work: Path) -> tuple[dict, list[str]]:
    """name -> (command, env, model name to send); and notes on peers left out."""
    gguf, notes, found = smollm2_gguf(), [], {}
    port = free_port()
    found[MINIMLX] = (
        [sys.executable, "-m", "minimlx", "serve", "--port", str(port), "--max-batch", "16", "--dtype", "float32"],
        {},
        port,
        "smollm2-135m",
    )
    if importlib.util.find_spec("minimlx_native") is not None:
        port = free_port()
        found[MINIMLX_KERNEL] = (
            [sys.executable, "-m", "minimlx", "serve", "--port", str(port), "--max-batch", "16"],
            {},
            port,
            "smollm2-135m",
        )
    else:
        notes.append("the native kernel is not built here: minimlx's packed row was left out")
    if importlib.util.find_spec("mlx_lm") is not None:
        from minimlx.cpu import blas

        folder, port = float32_folder(gguf, work), free_port()
        env = (
            {
                "LD_PRELOAD": blas.loaded,
                "MKL_THREADING_LAYER": os.environ.get("MKL_THREADING_LAYER", "GNU"),
                "MKL_NUM_THREADS": "1",
            }
            if blas.loaded
            else {}
        )  # as minimlx serve runs MKL
        found["mlx-lm server, float32" + (f", {Path(blas.loaded).name} preloaded" if blas.loaded else "")] = (
            [
                sys.executable,
                "-m",
                "mlx_lm",
                "server",
                "--model",
                str(folder),
                "--port",
                str(port),
                "--decode-concurrency",
                "16",
            ],
            env,
            port,
            str(folder),
        )
    else:
        notes.append("mlx-lm is not installed: its server was left out")
    if importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("sse_starlette") is not None:
        port = free_port()
        found["llama.cpp server (llama-cpp-python), Q4_1"] = (
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--n_threads", "2"],
            {},
            port,
            str(gguf),
        )
    else:
        notes.append("llama-cpp-python[server] is not installed: llama.cpp's server was left out")
    return found, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minimlx-bench")
    parser.add_argument("--json-schema", action="store_true", help="also time minimlx's bursts under a JSON schema")
    args = parser.parse_args()
    if args.rounds < 1 or args.tokens < 1 or min(args.clients) < 1:
        parser.error("--rounds, --tokens and every --clients count must be at least 1")
    args.work.mkdir(parents=True, exist_ok=True)
    found, notes = servers(args.work)
    rows, structured = {}, {}
    for name, (command, env, port, model) in found.items():
        process = start(command, env, port, args.work / f"{name.split()[0]}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            stream_chat(url, model, "a warm-up", 8)
            constrained = args.json_schema and name.startswith("minimlx")
            rounds, schema_rounds = [], []
            for _ in range(args.rounds):  # the two kinds of burst alternate, so that both see the same machine
                rounds.append({})
                schema_rounds.append({})
                for n in args.clients:
                    rounds[-1][n] = burst(url, model, n, args.tokens)
                    if constrained:
                        schema_rounds[-1][n] = burst(url, model, n, args.tokens, STORY)
            if constrained:
                structured[name] = {n: statistics.median(r[n][0] for r in schema_rounds) for n in args.clients}
            rows[name] = {
                n: (
                    statistics.median(r[n][0] for r in rounds),
                    statistics.median(r[n][1] for r in rounds),
                    sum(r[n][2] for r in rounds),
                )
                for n in args.clients
            }
            print(name, "rounds:", {n: [round(r[n][0], 1) for r in rounds] for n in args.clients}, flush=True)
        finally:
            process.terminate()
            process.wait(timeout=30)
        summary = {
            n: f"{tps:.1f} tok/s, TTFT {ttft:.2f} s, {failed} failed" for n, (tps, ttft, failed) in rows[name].items()
        }
        print(name, summary, flush=True)

    print(
        f"\n{machine()}\n\nSmolLM2-135M-Instruct, {args.tokens} generated tokens per request, temperature 0, "
        f"medians of {args.rounds} rounds:\n"
    )
    print("| server | " + " | ".join(f"{n} clients tok/s | TTFT s" for n in args.clients) + " |")
    print("| --- |" + " ---: | ---: |" * len(args.clients))
    for name, by_clients in rows.items():
        print(
            f"| {name} | "
            + " | ".join(
                f"{tps:.1f}{f' ({failed} failed)' if failed else ''} | {ttft:.2f}"
                for tps, ttft, failed in by_clients.values()
            )
            + " |"
        )
    alone = args.clients[0]
    for mine in (name for name in (MINIMLX, MINIMLX_KERNEL) if name in rows):
        ours = rows[mine]
        print(f"\n{mine}:")
        for n in args.clients[1:]:
            print(f"- at {n} clients / at {alone}: {ours[n][0] / ours[alone][0]:.1f}x", end="")
            for name, by_clients in rows.items():
                if not name.startswith("minimlx") and n in by_clients:
                    print(f"; / {name} at {n}: {ours[n][0] / by_clients[n][0]:.1f}x", end="")
            print()
    if structured:
        print("\nJSON-schema requests (response_format json_schema) / unconstrained ones, aggregate tokens/s:\n")
        print("| server | " + " | ".join(f"{n} clients" for n in args.clients) + " |")
        print("| --- |" + " ---: |" * len(args.clients))
        for name, by_clients in structured.items():
            ratios = (
                f"{by_clients[n]:.1f} / {rows[name][n][0]:.1f} = {by_clients[n] / rows[name][n][0]:.2f}x"
                for n in args.clients
            )
            print(f"| {name} | " + " | ".join(ratios) + " |")
    for note in notes:
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
