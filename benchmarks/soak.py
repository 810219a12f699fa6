"""A soak test of `minimlx serve`: many clients for N minutes under a mix of requests, and what it did to the server.

The mix (seeded, weighted by KINDS): whole and streamed completions, streams cut off after their first event,
long-prompt streams closed before their prefill is done, long prompts, bad requests, and bursts of 24 at once
past the queue (--max-queue 16: some are answered 429, as they should be, and so are other requests meanwhile).
Printed: each kind's count and outcome, unexpected answers (a 5xx, a dropped connection, a 4xx but 429 to a good
request), p50/p99 latency, aggregate tokens/s, the server's RSS over time, and its exit status after SIGTERM.

    python benchmarks/soak.py --minutes 10                 # SmolLM2-135M
    python benchmarks/soak.py --minutes 1 --model FOLDER --long-words 150

tests/test_server_soak.py runs a short version against a tiny random model.
"""

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import psutil

KINDS = {"whole": 30, "stream": 20, "cut_off": 10, "cancelled_prefill": 10, "long_prompt": 10, "bad": 10, "burst": 10}
BAD_BODIES = [b'{"prompt": ', {"prompt": "x", "max_tokens": "9"}, {"prompt": "x", "temperature": 5}, {"max_tokens": 3}]
BURST = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    """A server process and the clients that soak it; `stats` fills as they run."""

    def __init__(self, model: str, long_words: int, seed: int = 0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "minimlx", "serve", "--model", model, "--port", str(self.port)]
        command += ["--max-batch", "8", "--max-queue", "16", "--request-timeout", "60"]
        # its stderr (a line per request) goes to a file: a pipe nobody reads would fill up and stop the server
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.long_words, self.seed = long_words, seed
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.unexpected: list[str] = []
        self.latencies: list[float] = []
        self.tokens = 0
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MB)
        self.lock = threading.Lock()
        deadline = time.monotonic() + 180
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"the server did not start: {self.log.read()}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                return True
        except OSError:
            return False

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=30)

    def post(self, body, stream: bool = False, cut: int | None = None) -> tuple[int, int]:
        """(status, tokens) of one completion request; `cut` closes a stream after that many events."""
        data = body if isinstance(body, bytes) else json.dumps({**body, "stream": stream}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=data)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                if not stream:
                    return response.status, json.load(response)["usage"]["completion_tokens"]
                tokens = 0
                for line in response:
                    if tokens == cut:
                        break
                    tokens += line.startswith(b'data: {"id"')
                return response.status, tokens
        except urllib.error.HTTPError as e:
            e.read()
            return e.code, 0

    def prompt(self, rng: random.Random, words: int) -> str:
        return " ".join(f"w{rng.randrange(3, 100)}" for _ in range(words))

    def one(self, rng: random.Random, kind: str) -> None:
        """One request (or burst) of `kind`, its outcome recorded."""
        words, most = rng.randrange(2, 12), rng.randrange(4, 48)
        body = {"prompt": self.prompt(rng, words), "max_tokens": most, "temperature": 0.7}
        started = time.monotonic()
        try:
            if kind == "burst":
                with ThreadPoolExecutor(BURST) as pool:
                    results = list(pool.map(lambda _: self.post(body), range(BURST)))
            elif kind == "bad":
                results = [self.post(rng.choice(BAD_BODIES))]
            elif kind == "long_prompt":
                results = [self.post({**body, "prompt": self.prompt(rng, self.long_words), "max_tokens": 8})]
            elif kind == "cancelled_prefill":  # the headers come at once; closed then, the prefill is still running
                results = [self.post({**body, "prompt": self.prompt(rng, self.long_words)}, stream=True, cut=0)]
            else:
                results = [self.post(body, stream=kind != "whole", cut=1 if kind == "cut_off" else None)]
        except OSError as e:
            results = [(f"{type(e).__name__}", 0)]
        seconds = time.monotonic() - started
        with self.lock:
            for status, tokens in results:
                self.outcomes[kind][status] += 1
                self.tokens += tokens
                expected = (400,) if kind == "bad" else (200, 429)  # a burst fills the queue, for everyone
                if status not in expected:
                    self.unexpected.append(f"{kind}: {status}")
            if kind in ("whole", "stream"):
                self.latencies.append(seconds)

    def run(self, seconds: float, clients: int = 6) -> None:
        began = time.monotonic()
        server = psutil.Process(self.process.pid)

        def client(i: int) -> None:
            rng = random.Random(self.seed * 1000 + i)
            while time.monotonic() - began < seconds:
                self.one(rng, rng.choices(list(KINDS), list(KINDS.values()))[0])

        with ThreadPoolExecutor(clients) as pool:
            running = [pool.submit(client, i) for i in range(clients)]
            while not all(f.done() for f in running):
                self.rss.append((time.monotonic() - began, server.memory_info().rss / 1e6))
                time.sleep(min(5, seconds / 12))
            for f in running:
                f.result()
        time.sleep(1)  # idle: the engine thread hands MLX's freed buffers back
        self.rss.append((time.monotonic() - began, server.memory_info().rss / 1e6))
        self.seconds = time.monotonic() - began

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def report(self) -> str:
        lines = ["| kind | requests | answers |", "| --- | --- | --- |"]
        for kind in KINDS:
            counts = self.outcomes[kind]
            answers = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items(), key=str))
            lines.append(f"| {kind} | {sum(counts.values())} | {answers} |")
        lines += [
            "",
            f"unexpected answers: {len(self.unexpected)} {Counter(self.unexpected).most_common(5)}",
            f"latency of whole and streamed requests: p50 {self.percentile(0.5):.2f} s, "
            f"p99 {self.percentile(0.99):.2f} s",
            f"tokens generated: {self.tokens} in {self.seconds:.0f} s, {self.tokens / self.seconds:.1f} tokens/s",
            "RSS (MB) over time: " + ", ".join(f"{t:.0f} s: {mb:.0f}" for t, mb in self.rss),
        ]
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long-words", type=int, default=1500, help="words in a long prompt")
    parser.add_argument("--clients", type=int, default=6)
    args = parser.parse_args()
    soak = Soak(args.model, args.long_words)
    try:
        soak.run(args.minutes * 60, args.clients)
    finally:
        status = soak.stop()
    print(soak.report())
    print(f"server exit status after SIGTERM: {status}")


if __name__ == "__main__":
    main()
