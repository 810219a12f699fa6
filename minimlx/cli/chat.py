"""`minimlx chat`: an interactive conversation that keeps its KV cache between turns."""

import sys
from contextlib import closing

import click

from ..errors import InvalidSettingError, MinimlxError
from ..text.replies import ReplyParser
from .group import clean, image_limits, main
from .run import (
    generation_options,
    open_model,
    print_stats,
    saved_prompt,
    settings_from_options,
    speculation,
)

HELP = (
    "/image PATH sends a picture with your next message, /reset starts over, /exit (or Ctrl-D) leaves, "
    "Ctrl-C stops an answer."
)


def show(delta, hide_thinking: bool) -> None:
    """A reply's piece on stdout: thinking dimmed (or not at all), the answer as it is."""
    if delta.kind == "reasoning" and not hide_thinking:
        click.echo(click.style(delta.text, dim=True), nl=False)
    elif delta.kind == "content":
        click.echo(delta.text, nl=False)


def image_file(path: str, model, limits):
    """The picture file `/image PATH` names, checked before the next message: one that is there, readable and within
    the limits, for an image-text model."""
    from ..vision import open_image

    if not path:
        raise InvalidSettingError("/image needs the path of a picture: /image photo.jpg")
    if "vision" not in model:
        raise InvalidSettingError("this model reads text only; load an image-text model to send pictures")
    limits.check([path])
    open_image(path, limits.max_pixels)
    return path


@main.command()
@generation_options
@click.option("--hide-thinking", is_flag=True, help="Leave out a reasoning model's thinking (shown dimmed by default).")
def chat(hide_thinking, **options):
    """Talk with a model. Only each new turn is prefilled: the cache holds the conversation."""
    settings = settings_from_options(options)
    limits = image_limits(options)
    if sys.stdin is None:
        raise InvalidSettingError("standard input is closed; chat reads your turns from it")
    from ..decode import Conversation

    model, tokenizer = open_model(options)
    drafting = speculation(options)
    saved = saved_prompt(options, model, tokenizer)
    conversation = Conversation(model, tokenizer, options["system"], options["kv_bits"], saved, options["max_kv_size"])
    pending = []  # pictures for the next message (/image)
    interactive = sys.stdin.isatty()
    sys.stdin.reconfigure(errors="surrogateescape")  # a line of invalid UTF-8 is cleaned, not fatal
    if interactive:
        click.echo(HELP, err=True)
    while True:
        try:
            line = clean(input(">>> " if interactive else ""), "this line").strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo()
            continue
        if line == "/exit":
            break
        if line == "/reset":
            conversation.reset()
            pending = []
            continue
        if line.startswith("/image"):
            path = line[len("/image") :].strip()
            try:
                pending.append(image_file(path, model, limits))
                click.echo(f"(the picture goes with your next message: {len(pending)} so far)", err=True)
            except MinimlxError as e:
                click.echo(f"error: {e}", err=True)
            continue
        if not line:
            continue
        response = parser = None
        images, pending = pending, []
        try:
            with closing(conversation.say(line, settings, images, **drafting)) as responses:
                for response in responses:
                    parser = parser or ReplyParser(tokenizer.chat_template, False, True, conversation.prompt)
                    for delta in parser.feed(response.text):
                        show(delta, hide_thinking)
                    sys.stdout.flush()
            for delta in parser.close() if parser else []:
                show(delta, hide_thinking)
        except KeyboardInterrupt:
            pass
        except MinimlxError as e:
            click.echo(f"\nerror: {e}", err=True)
        sys.stdout.write("\n")
        if options["stats"] and response is not None:
            print_stats(response)
