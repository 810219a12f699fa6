"""The explainer page: one HTML document over the script and style in assets/ (plain JS, SVG and canvas, no build
step, nothing fetched from elsewhere). Served, it reads the API at its own address; standalone (`--html`, Jupyter)
it carries its walk as JSON inside and inlines its script and style."""

import html
import json
import secrets
from pathlib import Path

HERE = Path(__file__).parent / "assets"
ASSETS = {"explain.js": HERE / "explain.js", "explain.css": HERE / "explain.css"}


def fragment(title: str, data: dict | None) -> str:
    """The explainer's root element and the script call that fills it: the page's body, or a notebook cell."""
    root = f"mx-{secrets.token_hex(4)}"
    options = {"api": data is None, "data": data}
    payload = json.dumps(options, ensure_ascii=False).replace("</", "<\\/")  # no `</script>` inside the script
    inline = data is not None
    style = f"<style>{ASSETS['explain.css'].read_text()}</style>" if inline else ""
    script = f"<script>{ASSETS['explain.js'].read_text()}</script>" if inline else ""
    return (
        f'{style}<div class="mx-explain" id="{root}" data-title="{html.escape(title)}"></div>{script}'
        f'<script>minimlxExplain(document.getElementById("{root}"), {payload});</script>'
    )


def page(title: str, data: dict | None = None) -> str:
    """A whole HTML document: live on the API when `data` is None, else standalone with `data` (walk, info,
    ledger, compare) inside."""
    head = (
        ""
        if data is not None
        else '<link rel="stylesheet" href="/assets/explain.css"><script src="/assets/explain.js"></script>'
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        f"<title>minimlx explain: {html.escape(title)}</title>{head}</head>"
        f"<body>{fragment(title, data)}</body></html>"
    )
