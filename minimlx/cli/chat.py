"""`minimlx chat`: an interactive conversation that keeps its KV cache between turns."""

import sys
from contextlib import closing

import click

from ..errors import InvalidSettingError, MinimlxError
from . import clean, main
from .run import generation_options, open_model, print_stats, settings_from_options, speculation

HELP = "/reset starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer."


@main.command()
@generation_options
def chat(**options):
    """Talk with a model. Only each new turn is prefilled: the cache holds the conversation."""
    settings = settings_from_options(options)
    if sys.stdin is None:
        raise InvalidSettingError("standard input is closed; chat reads your turns from it")
    from ..decode import Conversation

    model, tokenizer = open_model(options)
    drafting = speculation(options)
    conversation = Conversation(model, tokenizer, options["system"])
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
        response = None
        try:
            with closing(conversation.say(line, settings, **drafting)) as responses:
                for response in responses:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        except MinimlxError as e:
            click.echo(f"\nerror: {e}", err=True)
        sys.stdout.write("\n")
        if options["stats"] and response is not None:
            print_stats(response)
