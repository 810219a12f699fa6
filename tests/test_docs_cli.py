"""docs/cli.md runs as written: every `$ minimlx ...` line in its console blocks, with the output it shows.

A block fenced as ```console has its output checked: the documented lines must be the output's lines
(a line `...` stands for any number of lines). A block fenced as ```console varies (timings, sampled
text) only has to exit with status 0. Every command and option of the CLI must appear in the page.
"""

import re
import subprocess
from pathlib import Path

import click
import pytest

from minimlx.cli import main

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
BLOCK = re.compile(r"^```console( varies)?\n(.*?)^```", re.S | re.M)


def documented_commands() -> list[tuple[str, list[str] | None]]:
    """(command line, documented output lines or None when the block varies) for each `$ ` line."""
    runs = []
    for varies, body in BLOCK.findall(CLI_MD.read_text()):
        for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
            command, *output = chunk.rstrip("\n").split("\n")
            runs.append((command, None if varies else [line.rstrip() for line in output]))
    return runs


COMMANDS = documented_commands()


def matches(documented: list[str], actual: list[str]) -> bool:
    """The documented lines in order, where `...` matches any run of lines."""
    pattern = "".join(r"(?:.*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in documented)
    return re.fullmatch(pattern, "".join(line + "\n" for line in actual)) is not None


def test_the_page_has_commands_for_every_subcommand():
    ran = {name for command, _ in COMMANDS for name in re.findall(r"\bminimlx ([a-z]+)", command)}
    assert sorted(main.commands) == sorted(ran)


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_option_is_documented(name):
    text = CLI_MD.read_text()
    options = [opt for p in main.commands[name].params if isinstance(p, click.Option) for opt in p.opts]
    assert [opt for opt in options if opt.startswith("--") and f"`{opt}" not in text] == []


@pytest.mark.parametrize("command, output", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_documented_command_runs_as_written(command, output, tmp_path):
    run = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=300,
    )
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
