"""`minimlx explain`: the walk from tokens to the next token, on a page (served, or written to one file)."""

from pathlib import Path

import click

from ..errors import InvalidSettingError
from ..loading import load
from .group import TEXT, dtype_option, inspection_dtype, main
from .serve import check_address


@main.command()
@click.option("--model", "-m", help="Checkpoint folder, .gguf file, Hugging Face repo id or smollm2-135m.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the page is served on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port it is served on.")
@click.option("--prompt", type=TEXT, help="With --html: the prompt whose walk the file shows.")
@click.option(
    "--chat-template", "chat", is_flag=True, help="With --html: the prompt as a user message in the chat template."
)
@click.option(
    "--html", "html_path", type=click.Path(dir_okay=False), help="Write one self-contained page to this file and exit."
)
@click.option(
    "--compare",
    nargs=3,
    type=TEXT,
    metavar="FIRST SECOND WORD",
    help="With --html: WORD's drift between sentences FIRST and SECOND beside the walk.",
)
@click.option(
    "--against",
    type=click.Choice(["float16", "bfloat16", "quantized"]),
    help="Also load the model at this precision, for the page's side-by-side precision view.",
)
@click.option(
    "--adapter",
    metavar="PATH",
    help="Load the model with this adapter (PEFT's or mlx-lm's folder): the walk is the adapted model's, beside the "
    "base's (the model with the adapter detached) on the same prompt.",
)
@click.option(
    "--image",
    "image_path",
    metavar="PATH",
    help="A picture (PNG, JPEG, WebP, GIF) for an image-text model: every prompt walked holds it before its text, and "
    "the image panel shows it with its patches and a token's attention to it.",
)
@dtype_option
def explain(model, host, port, prompt, chat, html_path, compare, against, adapter, image_path, dtype):
    """Show the walk from tokens to the next token: serve the page, or with --html write it to one file."""
    from ..explainer import explain as walk_of
    from ..io.resolve import DEFAULT_MODEL

    name = model or DEFAULT_MODEL
    if html_path is None and (prompt is not None or compare or chat):
        raise click.UsageError(
            "--prompt, --chat-template and --compare go with --html (the served page takes them typed)"
        )
    if html_path is not None and prompt is None:
        raise click.UsageError("--html needs --prompt, the prompt whose walk the file shows")
    if html_path is None:
        check_address(host, port)
    if image_path is not None and not Path(image_path).is_file():
        raise InvalidSettingError(f"no such image file: {image_path}; give the path of a PNG, JPEG, WebP or GIF file")
    loaded, tokenizer = load(name, dtype=inspection_dtype(dtype), adapter=adapter)
    title = name if adapter is None else f"{name} + adapter {adapter}"
    if html_path is not None:
        explained = walk_of(loaded, tokenizer, prompt, chat, compare=compare or None, title=title, image=image_path)
        explained.save(html_path)
        click.echo(f"wrote {html_path}", err=True)
        return
    import uvicorn

    from ..explainer.images import ExplainedImage
    from ..explainer.server import ExplainServer

    image = ExplainedImage.read(loaded, tokenizer, image_path) if image_path is not None else None
    second = load(name, dtype=against, adapter=adapter)[0] if against else None
    server = ExplainServer(loaded, tokenizer, title, second, against, image)
    click.echo(f"minimlx explain shows {title} on http://{host}:{port}/ (Ctrl-C stops)", err=True)
    uvicorn.run(server.app, host=host, port=port, log_level="warning")
