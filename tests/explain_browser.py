"""Headless Chromium (Debian's, through Playwright) and an in-process explainer server, for the page's tests."""

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
from servers import free_port

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def chromium():
    """(playwright, browser); in CI a missing browser fails the tests instead of skipping them."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package is not installed (pip install -e '.[dev]')"
    else:
        missing = None if shutil.which(CHROMIUM) else f"{CHROMIUM} is missing (apt-get install chromium)"
    if missing:
        pytest.fail(missing) if os.environ.get("CI") else pytest.skip(missing)
    playwright = sync_playwright().start()
    return playwright, playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)


class Explained:
    """An `ExplainServer` on uvicorn in a thread, at `url` (every prompt holding `image`, an `ExplainedImage`)."""

    def __init__(self, model, tokenizer, name: str, image=None):
        import uvicorn

        from minimlx.explainer.server import ExplainServer

        self.url = f"http://127.0.0.1:{free_port()}"
        app = ExplainServer(model, tokenizer, name, image=image).app
        config = uvicorn.Config(app, port=int(self.url.rsplit(":", 1)[1]), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def post(self, path: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data), timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


class Page:
    """A browser page that records its errors and every request it makes."""

    def __init__(self, browser, url: str | None = None):
        self.page = browser.new_page()
        self.errors, self.requests = [], []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("request", lambda r: self.requests.append(r.url))
        if url:
            self.page.goto(url)

    def walks(self) -> int:
        return int(self.page.locator(".mx-explain").get_attribute("data-ready"))

    def after(self, action) -> None:
        """Do `action` (a click, a submit) and wait for the walk it starts to be drawn."""
        count = self.walks()
        action()
        self.page.wait_for_function(
            f"Number(document.querySelector('.mx-explain').dataset.ready) > {count}", timeout=120_000
        )

    def explain(self, prompt: str) -> None:
        self.page.fill("textarea[name=prompt]", prompt)
        self.after(lambda: self.page.click("button[type=submit]"))

    def next_probs(self) -> dict[int, float]:
        rows = self.page.locator("[data-panel=next] .mx-next-row")
        return {int(r.get_attribute("data-id")): float(r.get_attribute("data-prob")) for r in rows.all()}

    def lens_tokens(self) -> dict[tuple[int, int], str]:
        cells = self.page.locator(".mx-lens td").evaluate_all(
            "cells => cells.map(c => [Number(c.dataset.row), Number(c.dataset.position), c.dataset.token])"
        )
        return {(r, p): t for r, p, t in cells}
