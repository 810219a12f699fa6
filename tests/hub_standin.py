"""A local stand-in for the Hugging Face Hub (what `HF_ENDPOINT` points huggingface_hub at in tests): it serves the
repos of a folder (`ROOT/ORG/NAME/files...`) through the endpoints huggingface_hub calls to list and download files
(`/api/models/REPO/tree/REV`, `/api/models/REPO/revision/REV`, `/REPO/resolve/REV/PATH` with ranges), answers a
gated repo 401 as the Hub does, and can cut one download short, to test resuming."""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class StandinHub:
    def __init__(self, root: Path, gated: tuple[str, ...] = ()):
        self.root, self.gated = root, set(gated)
        self.cut_once: set[str] = set()  # files whose next download stops halfway
        self.requests: list[str] = []
        self.ranges: list[str] = []  # the Range headers of file downloads, in order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo, rest = "/".join(parts[2:4]), parts[4:]
        else:
            repo, rest = "/".join(parts[:2]), parts[2:]
        folder = self.root / repo
        if repo in self.gated:
            return self.refuse(handler, 401, "GatedRepo", f"Access to model {repo} is restricted.")
        if not folder.is_dir():
            return self.refuse(handler, 404, "RepoNotFound", "Repository Not Found")
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        if parts[:2] == ["api", "models"] and rest[:1] == ["tree"]:
            listing = [
                {"type": "file", "path": f, "size": (folder / f).stat().st_size, "oid": oid(folder / f)} for f in files
            ]
            return self.send_json(handler, listing)
        if parts[:2] == ["api", "models"]:
            info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files], "private": False}
            return self.send_json(handler, info)
        if rest[:1] == ["resolve"]:
            name = "/".join(rest[2:])
            if name not in files:
                return self.refuse(handler, 404, "EntryNotFound", "Entry not found")
            return self.send_file(handler, folder / name, body)
        return self.refuse(handler, 404, None, "no such endpoint")

    def refuse(self, handler, status: int, code: str | None, message: str) -> None:
        handler.send_response(status)
        if code:
            handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", message)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def send_json(self, handler, value) -> None:
        data = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def send_file(self, handler, path: Path, body: bool) -> None:
        data = path.read_bytes()
        start = 0
        ranged = handler.headers.get("Range", "")
        if ranged.startswith("bytes="):
            start = int(ranged.removeprefix("bytes=").split("-")[0])
            if body:
                self.ranges.append(ranged)
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if not body:
            return
        name = path.name
        if name in self.cut_once:
            self.cut_once.discard(name)
            handler.wfile.write(data[start : start + (len(data) - start) // 2])
            handler.wfile.flush()
            handler.connection.close()
            return
        handler.wfile.write(data[start:])


def oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()
