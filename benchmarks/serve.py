"""Concurrent streaming requests against minimlx serve and its peers, SmolLM2-135M (or --model), same weights.

    python benchmarks/serve.py [--clients 1 4 8 16] [--tokens 64] [--prompt-tokens 128] [--rounds 3]
                               [--build-llamacpp] [--skip NAMES] [--work DIR] [--json-schema] [--model FILE]

--model serves another GGUF file with SmolLM2's vocabulary (benchmarks/synthetic_gguf.py's, e.g. the 1.1B
LLaMA-shaped Q4_K_M) by minimlx serve as it starts by default and by llama-server, the two rows compared; the
float32 and Python peers' rows are SmolLM2's alone.

Every server starts in its own process on a free port, all of them before the first burst, and answers one
warm-up request. A round then gives each server in turn, for each N in --clients, N clients that send one
streaming raw completion each (`/v1/completions`, the one request shape every server here takes) at the same
moment and read it to the end: a prompt of --prompt-tokens random words that are one token each, new for each
request and the same for every server (no server answers from a cached prefix), temperature 0, `max_tokens`
--tokens, and SmolLM2's end-of-text tokens banned by `logit_bias` so that every answer runs to --tokens.
Aggregate tokens/s = generated tokens of all N (as the server's usage counts them) / seconds from the sends to
the last token; time to first token (TTFT) is the median over the N requests of the seconds to their first
text delta. The tables give the medians of --rounds interleaved rounds (a busy machine slows one round of every
server, not one server), failed requests summed over the rounds, and the prompt lengths the servers counted.

--json-schema also sends every minimlx burst with `json_schema` set to a schema (a story object: a title, a
story of at least 400 characters so that the answer runs to --tokens as the unconstrained one does, tags),
burst for burst beside the unconstrained one, and reports the ratio of the two: what computing a grammar's
token mask at every step costs a batch.

Servers, each left out with a note when not installed: minimlx serve --dtype float32 (the GGUF dequantized);
minimlx serve as it starts by default with the native kernel of native/ installed (the GGUF's Q4_1 weights kept
packed, through the kernel); llama.cpp's own C++ `llama-server` on the GGUF as shipped, 8 slots with continuous
batching (`-np 8 -cb -t 2`), built by benchmarks/llamacpp_peer.py (`--build-llamacpp` builds it, or
`$LLAMA_CPP_BIN` names its folder); mlx-lm's server (`python -m mlx_lm server`, the GGUF's weights dequantized
to float32 by transformers, the BLAS minimlx loads preloaded so that both multiply with the same library, on one
thread as minimlx serve does); and llama-cpp-python's server (the GGUF as shipped, one request at a time). Peers
are benchmarks only, never minimlx dependencies.
"""

import argparse
import contextlib
import dataclasses
import http.client
import importlib.util
import json
import os
import random
import re
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
import llamacpp_peer  # noqa: E402
from compare import ENVIRONMENT, float32_folder, machine, smollm2_gguf  # noqa: E402

# Words that are one token each in SmolLM2's vocabulary after a space: a prompt of N of them is N tokens.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river garden letter window music "
    "bread"
).split()
END_OF_TEXT = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|>: banned, so that every answer runs to max_tokens


def prompt_text(words: int, seed: str, ids: bool = False) -> str | list[int]:
    """`words` random words, each a token of its own: the same text for every server, a new one per request (so
    that no server answers from a cached prefix). With `ids`, as many random ordinary token ids instead (a --model
    file's tokenizer need not split the words as SmolLM2's does)."""
    rng = random.Random(seed)
    if ids:
        return [rng.randrange(1000, 30000) for _ in range(words)]  # ordinary ids in a 32k or a 49k vocabulary
    return "".join(" " + rng.choice(WORDS) for _ in range(words))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start(server: "Server", log: Path):
    """A server process, up and answering, for as long as the block runs."""
    process = subprocess.Popen(
        server.command, env=ENVIRONMENT | server.env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if time.monotonic() > deadline or process.poll() is not None:
                sys.exit(f"{server.command[:4]} did not start; see {log}")
            try:
                urllib.request.urlopen(f"{server.url}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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


def stream_completion(
    url: str, model: str, prompt: str | list[int], tokens: int, schema: dict | None = None
) -> tuple[float | None, int, int | None, bool]:
    """(seconds to the first text delta, generated tokens, prompt tokens the server counted, whether it failed) of
    one streaming raw completion. Generated tokens come from the usage the server reports, else one per delta."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "logit_bias": {str(token): -100 for token in END_OF_TEXT},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        body["json_schema"] = schema
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, first, deltas, usage = time.perf_counter(), None, 0, None
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if any(c.get("text") for c in chunk.get("choices", [])):
                    first = first or time.perf_counter() - start
                    deltas += 1
    except (OSError, http.client.HTTPException):  # refused, reset or cut short: a failed request
        return first, deltas, None, True
    usage = usage or {}
    return first, usage.get("completion_tokens", deltas), usage.get("prompt_tokens"), False


def burst(server: "Server", prompts: list[str], tokens: int, schema: dict | None = None) -> dict:
    """Aggregate generated tokens/s, median time to first token, failed requests and the prompt lengths the
    server counted, of one request per prompt sent at once."""
    results, go = [None] * len(prompts), threading.Barrier(len(prompts) + 1)

    def client(i):
        go.wait()
        results[i] = stream_completion(server.url, server.model, prompts[i], tokens, schema)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    first = [r[0] for r in results if r[0] is not None]
    return {
        "tps": sum(r[1] for r in results) / wall,
        "ttft": statistics.median(first) if first else float("nan"),
        "failed": sum(r[3] for r in results),
        "prompt_tokens": {r[2] for r in results if r[2] is not None},
    }


MINIMLX = "minimlx serve --dtype float32"


@dataclasses.dataclass
class Server:
    command: list[str]
    env: dict
    port: int
    model: str  # the model name its requests send

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def servers(
    work: Path, prompt_tokens: int, tokens: int, build: bool, model: Path | None = None
) -> tuple[dict[str, Server], list[str]]:
    """name -> Server for everything installed here, over SmolLM2's Q4_1 GGUF or the GGUF file `model`; and notes on
    peers left out."""
    gguf, notes, found = model or smollm2_gguf(), [], {}
    kind, name = ("Q4_1", "smollm2-135m") if model is None else (model.name, str(model))
    minimlx = [sys.executable, "-m", "minimlx", "serve", "--max-batch", "16"] + (
        [] if model is None else ["--model", name]
    )
    if model is None:
        port = free_port()
        found[MINIMLX] = Server(minimlx + ["--port", str(port), "--dtype", "float32"], {}, port, name)
    if importlib.util.find_spec("minimlx_native") is not None:
        port = free_port()
        found[f"minimlx serve (default: {kind} on the native kernel)"] = Server(
            minimlx + ["--port", str(port)], {}, port, name
        )
    else:
        notes.append("the native kernel is not built here: minimlx's packed row was left out")
    try:
        folder, port = llamacpp_peer.binaries(build), free_port()
        context = 8 * (prompt_tokens + tokens + 64)  # each of the 8 slots holds a whole request
        command = [str(folder / "llama-server"), "-m", str(gguf), "--port", str(port), "-np", "8", "-cb", "-t", "2"]
        found[f"llama-server -np 8 -cb -t 2, {kind}"] = Server(command + ["-c", str(context)], {}, port, name)
    except llamacpp_peer.PeerMissing as missing:
        notes.append(f"{missing}: llama-server was left out")
    if model is not None:
        return found, notes
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
        command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port)]
        found["mlx-lm server, float32" + (f", {Path(blas.loaded).name} preloaded" if blas.loaded else "")] = Server(
            command + ["--decode-concurrency", "16"], env, port, str(folder)
        )
    else:
        notes.append("mlx-lm is not installed: its server was left out")
    if importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("sse_starlette") is not None:
        port = free_port()
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port)]
        found["llama-cpp-python's server, Q4_1"] = Server(command + ["--n_threads", "2"], {}, port, str(gguf))
    else:
        notes.append("llama-cpp-python[server] is not installed: its server was left out")
    return found, notes


def load_average() -> str:
    return " ".join(f"{load:.1f}" for load in os.getloadavg())


def medians(rounds: list[dict], clients: list[int]) -> dict[int, tuple[float, float, int]]:
    """N -> (median aggregate tok/s, median TTFT, failed requests summed over the rounds)."""
    return {
        n: (
            statistics.median(r[n]["tps"] for r in rounds),
            statistics.median(r[n]["ttft"] for r in rounds),
            sum(r[n]["failed"] for r in rounds),
        )
        for n in clients
    }


def report(args, rows: dict, structured: dict, prompt_lengths: dict, notes: list[str], loads: list[str]) -> None:
    print(
        f"\n{machine()}\n{llamacpp_peer.description()}\n\n{args.model or 'SmolLM2-135M-Instruct'}, raw completions of "
        f"{args.prompt_tokens}-token prompts, {args.tokens} generated tokens per request, temperature 0, medians of "
        f"{args.rounds} interleaved rounds; load average before each round: {', '.join(loads)}:\n"
    )
    print("| server | " + " | ".join(f"{n} clients tok/s | TTFT s" for n in args.clients) + " |")
    print("| --- |" + " ---: | ---: |" * len(args.clients))
    for name, by_clients in rows.items():
        cells = (
            f"{tps:.1f}{f' ({failed} failed)' if failed else ''} | {ttft:.2f}"
            for tps, ttft, failed in by_clients.values()
        )
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(
        "\nprompt tokens as each server counted them: "
        + "; ".join(
            f"{name}: {', '.join(map(str, sorted(lengths))) or 'not reported'}"
            for name, lengths in prompt_lengths.items()
        )
    )
    peers = [name for name in rows if not name.startswith("minimlx")]
    ours = [name for name in rows if name.startswith("minimlx")]
    if ours and peers:
        print("\nminimlx / peer, aggregate tok/s (and TTFT, lower is better):\n")
        print("| minimlx row / peer | " + " | ".join(f"{n} clients" for n in args.clients) + " |")
        print("| --- |" + " ---: |" * len(args.clients))
        for mine in ours:
            for peer in peers:
                cells = (
                    f"{rows[mine][n][0] / rows[peer][n][0]:.2f}x (TTFT {rows[mine][n][1] / rows[peer][n][1]:.2f}x)"
                    if rows[peer][n][0] > 0
                    else "- (the peer answered nothing)"
                    for n in args.clients
                )
                print(f"| {mine} / {peer} | " + " | ".join(cells) + " |")
    alone = args.clients[0]
    for mine in ours:
        scaling = ", ".join(f"{n} clients {rows[mine][n][0] / rows[mine][alone][0]:.1f}x" for n in args.clients[1:])
        print(f"\n{mine} over its own {alone} client{'s' * (alone > 1)}: {scaling}")
    if structured:
        print("\nJSON-schema requests (`json_schema`) / unconstrained ones, aggregate tokens/s:\n")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minimlx-bench")
    parser.add_argument("--skip", default="", help="comma-separated substrings of servers to leave out")
    parser.add_argument("--json-schema", action="store_true", help="also time minimlx's bursts under a JSON schema")
    parser.add_argument("--model", type=Path, help="a GGUF file with SmolLM2's vocabulary (default: SmolLM2's Q4_1)")
    parser.add_argument(
        "--build-llamacpp", action="store_true", help="build llama.cpp's llama-server first if it is not built"
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.tokens < 1 or args.prompt_tokens < 1 or min(args.clients) < 1:
        parser.error("--rounds, --tokens, --prompt-tokens and every --clients count must be at least 1")
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model {args.model}: no such file; give a GGUF file (benchmarks/synthetic_gguf.py makes them)")
    args.work.mkdir(parents=True, exist_ok=True)
    found, notes = servers(args.work, args.prompt_tokens, args.tokens, args.build_llamacpp, args.model)
    found = {name: server for name, server in found.items() if not any(s and s in name for s in args.skip.split(","))}
    rounds = {name: [] for name in found}
    schema_rounds = {name: [] for name in found if args.json_schema and name.startswith("minimlx")}
    prompt_lengths = {name: set() for name in found}
    loads = []
    with contextlib.ExitStack() as running:
        for name, server in found.items():  # all up at once, so that their rounds can interleave
            log = args.work / (re.sub(r"[^\w.-]+", "-", name).strip("-") + ".log")
            running.enter_context(start(server, log))
        for server in found.values():
            stream_completion(
                server.url, server.model, prompt_text(args.prompt_tokens, seed="warm-up", ids=args.model is not None), 8
            )
        for round_ in range(args.rounds):
            loads.append(load_average())
            for name, server in found.items():
                rounds[name].append({})
                schema_rounds.get(name, []).append({})
                for n in args.clients:  # every server gets the same prompts, each burst new ones
                    prompts = [
                        prompt_text(args.prompt_tokens, seed=f"{round_}-{n}-{i}", ids=args.model is not None)
                        for i in range(n)
                    ]
                    rounds[name][-1][n] = result = burst(server, prompts, args.tokens)
                    prompt_lengths[name] |= result["prompt_tokens"]
                    if name in schema_rounds:  # the two kinds of burst alternate, so that both see the same machine
                        schema_rounds[name][-1][n] = burst(server, prompts, args.tokens, STORY)
                print(
                    f"round {round_ + 1} {name}:",
                    {n: round(r["tps"], 1) for n, r in rounds[name][-1].items()},
                    flush=True,
                )
    rows = {name: medians(runs, args.clients) for name, runs in rounds.items()}
    structured = {
        name: {n: statistics.median(r[n]["tps"] for r in runs) for n in args.clients}
        for name, runs in schema_rounds.items()
    }
    report(args, rows, structured, prompt_lengths, notes, loads)


if __name__ == "__main__":
    main()
