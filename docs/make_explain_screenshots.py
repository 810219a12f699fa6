"""Make docs/explain.md's screenshots from the real page: `python docs/make_explain_screenshots.py`.

Serves `minimlx explain` on SmolLM2 (float32, and its packed GGUF weights for the precision view) in this
process, drives it in headless Debian chromium through Playwright, and writes one PNG per panel to docs/images/.
"""

import socket
import threading
import time
from pathlib import Path

import uvicorn
from playwright.sync_api import sync_playwright

import minimlx
from minimlx.explainer.server import ExplainServer

IMAGES = Path(__file__).parent / "images"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]


def serve(app) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/"


def walked(page, action) -> None:
    """Do `action` and wait until the walk it starts is drawn."""
    count = int(page.locator(".mx-explain").get_attribute("data-ready"))
    action()
    page.wait_for_function(f"Number(document.querySelector('.mx-explain').dataset.ready) > {count}", timeout=120_000)


def shoot(page, panel: str, name: str) -> None:
    page.locator(f"[data-panel={panel}]").screenshot(path=IMAGES / f"explain-{name}.png")


def main() -> None:
    model, tokenizer = minimlx.load("smollm2-135m", dtype="float32")
    packed, _ = minimlx.load("smollm2-135m", dtype="quantized")
    url = serve(ExplainServer(model, tokenizer, "smollm2-135m", packed, "quantized").app)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.goto(url)
        page.wait_for_selector("button[name=precision]")
        page.fill("textarea[name=prompt]", "The capital of France is")
        walked(page, lambda: page.click("button[type=submit]"))
        shoot(page, "lens", "lens")
        page.select_option("select[name=layer]", "3")
        page.click("canvas[data-layer='3'][data-head='4']")
        shoot(page, "attention", "attention")
        shoot(page, "blocks", "blocks")
        page.locator("input[name=top_p]").fill("0.9")
        page.locator("input[name=top_p]").dispatch_event("change")
        page.wait_for_function("document.querySelector('[data-kept]').textContent.includes('top-p 0.9')")
        shoot(page, "next", "next")
        walked(page, lambda: page.click("button[name=ablate-block][data-layer='29']"))
        shoot(page, "next", "ablated")
        page.click("button[name=compare]")
        page.wait_for_selector("svg[data-similarity]")
        page.click("button[name=precision]")
        page.wait_for_selector("svg[data-precision]")
        shoot(page, "compare", "drift")
        shoot(page, "ledger", "ledger")
        browser.close()
    for png in sorted(IMAGES.glob("explain-*.png")):
        print(f"{png.name}: {png.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
