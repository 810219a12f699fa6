"""`minimlx serve` processes for the tests: a free port, waiting until one serves, and how to reach it."""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from reference import require

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, process: subprocess.Popen, log=None, seconds: float = 120) -> None:
    """Return once `url`/health answers; fail with the server's stderr (the file `log`, else its pipe) if `process`
    exits or time runs out."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                if log is not None:
                    log.seek(0)
                pytest.fail(f"the server did not start: {(log or process.stderr).read()}")
            time.sleep(0.2)


class Served:
    """A `minimlx serve` process and how to reach it. Its stderr (a line per request) goes to a file, which
    `log()` reads: a pipe nobody reads would fill up and stop the server."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "minimlx", "serve", "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            text=True,
        )
        try:
            wait_until_serving(self.url, self.process, self.stderr)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        """What the server wrote on stderr so far."""
        self.stderr.seek(0)
        return self.stderr.read()

    def client(self, api_key: str = "none"):
        openai = require("openai")
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, timeout=60, max_retries=0)

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        """(status, JSON body) of a raw POST; `body` as bytes is sent as it is."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def wait_for(self, running: int, waiting: int, seconds: float = 30) -> None:
        """Return once /health counts `running` answers and `waiting` requests; fail after `seconds`."""
        deadline, wanted = time.monotonic() + seconds, {"status": "ok", "running": running, "waiting": waiting}
        while True:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
                health = json.load(response)
            if health == wanted:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"the server's /health stayed at {health}, not {wanted}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
