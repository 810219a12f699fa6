"""docs/cli.md runs as written: every `$ minimlx ...` line in its console blocks, with the output it shows.

A block fenced as ```console has its output checked: the documented lines must be the output's lines
(a line `...` stands for any number of lines). A block fenced as ```console varies (timings, sampled
text) only has to exit with status 0. Every command and option of the CLI must appear in the page.
"""

import re
from pathlib import Path

import click
import pytest
from doc_pages import console_commands, matches, shell

from minimlx.cli import main

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
COMMANDS = console_commands(CLI_MD)


def test_the_page_has_commands_for_every_subcommand():
    ran = {name for command, _ in COMMANDS for name in re.findall(r"\bminimlx ([a-z][a-z-]*)", command)}
    assert sorted(main.commands) == sorted(ran)


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_option_is_documented(name):
    text = CLI_MD.read_text()
    options = [opt for p in main.commands[name].params if isinstance(p, click.Option) for opt in p.opts]
    assert [opt for opt in options if opt.startswith("--") and f"`{opt}" not in text] == []


@pytest.mark.slow
@pytest.mark.parametrize("command, output", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_documented_command_runs_as_written(command, output, tmp_path):
    run = shell(command, tmp_path)
    assert run.returncode == 0, run.stdout
    if output is not None:
        actual = [line.rstrip() for line in run.stdout.rstrip("\n").split("\n")]
        assert matches(output, actual), "\n".join(["documented:", *output, "actual:", *actual])


def test_matches_elides_only_where_the_page_says_so():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert matches(["a", "...", "d"], ["a", "d"])
    assert not matches(["a", "d"], ["a", "b", "d"])
    assert not matches(["a", "...", "d"], ["a", "b", "c"])
    assert matches(["...", "c"], ["a", "b", "c"])
    assert matches(["...", "c"], ["c"])
    assert matches(["p 24.3 of 0.95"], ["p 24.2 of 0.96"])
    assert not matches(["p 24.3"], ["p 24.1"])
    assert not matches(["step 3"], ["step 4"])
