"""`minimlx chat`: an interactive conversation that keeps its KV cache between turns."""

import sys
from contextlib import closing

import click

from ..errors import MinimlxError
from . import main
from .run import generation_options, open_model, print_stats, sampling

HELP = "/reset starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer."


@main.command()
@generation_options
def chat(**options):
    """Talk with a model. Only each new turn is prefilled: the cache holds the conversation."""
    settings = sampling(options)
    from ..generate import Conversation

    model, tokenizer = open_model(options)
    conversation = Conversation(model, tokenizer, options["system"])
    interactive = sys.stdin.isatty()
    if interactive:
        click.echo(HELP, err=True)
    while True:
        try:
            line = input(">>> " if interactive else "").strip()
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
            with closing(conversation.say(line, **settings)) as responses:
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
