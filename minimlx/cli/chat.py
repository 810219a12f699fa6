"""`minimlx chat`: an interactive conversation that keeps its KV cache between turns."""

import sys
from contextlib import closing

import click

from ..errors import InvalidSettingError, MinimlxError
from ..text.replies import ReplyParser
from .group import clean, main
from .run import generation_options, open_model, print_stats, saved_prompt, settings_from_options, speculation

HELP = "/reset starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer."


def show(delta, hide_thinking: bool) -> None:
    """A reply's piece on stdout: thinking dimmed (or not at all), the answer as it is."""
    if delta.kind == "reasoning" and not hide_thinking:
        click.echo(click.style(delta.text, dim=True), nl=False)
    elif delta.kind == "content":
        click.echo(delta.text, nl=False)


@main.command()
@generation_options
@click.option("--hide-thinking", is_flag=True, help="Leave out a reasoning model's thinking (shown dimmed by default).")
def chat(hide_thinking, **options):
    """Talk with a model. Only each new turn is prefilled: the cache holds the conversation."""
    settings = settings_from_options(options)
    if sys.stdin is None:
        raise InvalidSettingError("standard input is closed; chat reads your turns from it")
    from ..decode import Conversation

    model, tokenizer = open_model(options)
    drafting = speculation(options)
    saved = saved_prompt(options, model, tokenizer)
    conversation = Conversation(model, tokenizer, options["system"], options["kv_bits"], saved, options["max_kv_size"])
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
            continue
        if not line:
            continue
        response = parser = None
        try:
            with closing(conversation.say(line, settings, **drafting)) as responses:
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
