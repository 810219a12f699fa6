"""The coding agents themselves (Claude Code and Codex CLI, the releases pinned in tests/agents/package.json), run
offline against a `minimlx serve` through a recording proxy, which passes every byte on as it arrives and keeps each
exchange, so that a test can compare what an agent printed with what the server sent it.
"""

import http.client
import http.server
import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from doc_pages import ROOT, blocks

AGENTS = Path(__file__).parent / "agents"
SERVE_MD = ROOT / "docs" / "serve.md"
DOCUMENTED_URL = "http://127.0.0.1:8080"  # the address docs/serve.md's recipes give
MANIFEST = AGENTS / "package.json"
PACKAGES = {"claude-code": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


def pinned(client: str) -> list[str]:
    """The versions of `client` ("claude-code" or "codex") that tests/agents/package.json installs, as aliases
    "<client>-<version>" of the npm package."""
    dependencies = json.loads(MANIFEST.read_text())["dependencies"]
    versions = [
        spec.rpartition("@")[2] for alias, spec in dependencies.items() if spec.startswith(f"npm:{PACKAGES[client]}@")
    ]
    assert versions, f"tests/agents/package.json pins no {PACKAGES[client]}"
    return versions


def installed_version(alias: str) -> str | None:
    manifest = AGENTS / "node_modules" / alias / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.is_file() else None


def install_agents() -> None:
    """Install the pinned agents (`npm ci` in tests/agents) unless they already are; skip when npm is missing."""
    wanted = {f"{client}-{version}": version for client in PACKAGES for version in pinned(client)}
    if all(installed_version(alias) == version for alias, version in wanted.items()):
        return
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip(
            "Node.js and npm are not installed: the coding agents' tests run Claude Code and Codex CLI from npm"
        )
    done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=AGENTS, capture_output=True, text=True)
    assert done.returncode == 0, f"`npm ci` in tests/agents failed:\n{done.stderr[-3000:]}"


@dataclass
class Exchange:
    """One request the proxy passed on, and the server's answer."""

    method: str
    path: str
    body: bytes
    status: int
    answer: bytes

    def request(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list[dict]:
        """The data of each server-sent event of a streamed answer."""
        return [
            json.loads(line[6:])
            for line in self.answer.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


class RecordingProxy:
    """An HTTP server on a free local port that forwards each request to `upstream` and streams the answer back as it
    comes (so keep-alives and token-by-token streams reach the agent as the server sent them), keeping each exchange
    in `exchanges`."""

    def __init__(self, upstream: str):
        self.exchanges: list[Exchange] = []
        target, exchanges = urlsplit(upstream), self.exchanges

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                answer = bytearray()
                while chunk := response.read1(65536):
                    answer += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                connection.close()
                exchanges.append(Exchange(self.command, self.path, body, response.status, bytes(answer)))

            do_GET = do_POST = do_HEAD = forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> "RecordingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and urlsplit(e.path).path == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def anthropic_text(exchange: Exchange) -> str:
    """The text of a Messages answer, streamed or whole."""
    if not exchange.answer.startswith(b"{"):
        return "".join(e["delta"].get("text", "") for e in exchange.events() if e["type"] == "content_block_delta")
    return "".join(block["text"] for block in json.loads(exchange.answer)["content"] if block["type"] == "text")


def responses_text(exchange: Exchange) -> str:
    """The text of a Responses answer, streamed or whole."""
    if not exchange.answer.startswith(b"{"):
        return "".join(e["delta"] for e in exchange.events() if e["type"] == "response.output_text.delta")
    items = json.loads(exchange.answer)["output"]
    return "".join(c["text"] for item in items if item["type"] == "message" for c in item["content"])


def anthropic_tool_uses(exchange: Exchange) -> list[dict]:
    """The tool_use blocks of a streamed Messages answer, their input put together from its JSON deltas."""
    blocks, inputs = {}, {}
    for event in exchange.events():
        if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            blocks[event["index"]], inputs[event["index"]] = event["content_block"], ""
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            inputs[event["index"]] += event["delta"]["partial_json"]
    return [{**block, "input": json.loads(inputs[index] or "{}")} for index, block in blocks.items()]


def responses_output(exchange: Exchange) -> list[dict]:
    """The output items of a streamed Responses answer, as its last event (response.completed) lists them."""
    return exchange.events()[-1]["response"]["output"]


def documented_block(language: str, holding: str) -> str:
    """The ```language block of docs/serve.md that holds `holding`."""
    [body] = [body for body, _, _ in blocks(SERVE_MD, language) if holding in body]
    return body


def documented_claude_code_env(url: str) -> dict[str, str]:
    """The environment docs/serve.md's Claude Code recipe exports, pointed at `url`."""
    lines = documented_block("bash", "ANTHROPIC_BASE_URL").splitlines()
    settings = [word for line in lines if line.startswith("export ") for word in line.split("#")[0].split()[1:]]
    return {name: value.replace(DOCUMENTED_URL, url) for name, _, value in (s.partition("=") for s in settings)}


def documented_codex_config(url: str) -> str:
    """The config.toml of docs/serve.md's Codex recipe, pointed at `url`."""
    config = documented_block("toml", "model_provider")
    assert DOCUMENTED_URL in config, f"docs/serve.md's Codex config names no {DOCUMENTED_URL}"
    return config.replace(DOCUMENTED_URL, url)


def claude_code(version: str, url: str, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run Claude Code `version` with `args` in `cwd` against `url`, set up as docs/serve.md says, with a home of its
    own (none of the user's login, settings or history)."""
    home = cwd.parent / f"{cwd.name}-home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **documented_claude_code_env(url)}
    binary = AGENTS / "node_modules" / f"claude-code-{version}" / "bin" / "claude.exe"
    return subprocess.run(
        [str(binary), *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def codex(version: str, url: str, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run Codex CLI `version` (`codex exec` with `args`) in `cwd` against `url`, configured as docs/serve.md says,
    in a CODEX_HOME of its own."""
    home = cwd.parent / f"{cwd.name}-codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(documented_codex_config(url))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
    script = AGENTS / "node_modules" / f"codex-{version}" / "bin" / "codex.js"
    return run_agent(["node", str(script), "exec", "--skip-git-repo-check", *args], cwd, env, timeout)


def run_agent(command: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """An agent's run, with nothing on its stdin (it would wait for more input) and its output kept."""
    return subprocess.run(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
