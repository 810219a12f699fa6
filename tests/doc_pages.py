"""Reading the runnable parts of a documentation page, and running its commands with this test's Python.

- ```console blocks hold `$ minimlx ...` lines, each followed by the output it prints (a line `...` stands
  for any number of lines); ```console varies blocks only have to exit with status 0.
- ```bash blocks hold commands; the `minimlx ...` ones are run (installs are not).
- ```python blocks either are `>>>` sessions (checked as doctests, one namespace per page), or programs
  starting with an import (run, and their printed text compared with the plain ``` block right after,
  if there is one), or excerpts of minimlx's source (not run).

`minimlx` on the PATH of a documented command is this test's Python running `-m minimlx`, whatever
`minimlx` is installed elsewhere.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)( varies)?\n(.*?)^```\n(?:\n```\n(.*?)^```)?", re.S | re.M)


def blocks(page: Path, language: str) -> list[tuple[str, bool, str | None]]:
    """(body, varies, the plain block right after it or None) of each ```language block."""
    return (
        [
            (body, bool(varies), after)
            for lang, varies, body, after in BLOCK.findall(page.read_text())
            if lang == language
        ]
        if page.is_file()
        else []
    )


def console_commands(page: Path) -> list[tuple[str, list[str] | None]]:
    """(command line, documented output lines or None when the block varies) for each `$ ` line."""
    runs = []
    for body, varies, _ in blocks(page, "console"):
        for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
            command, *output = chunk.rstrip("\n").split("\n")
            runs.append((command, None if varies else [line.rstrip() for line in output]))
    return runs


def bash_commands(page: Path) -> list[str]:
    """The `minimlx ...` lines of the page's ```bash blocks, comments dropped."""
    lines = [line.split("  #")[0].strip() for body, _, _ in blocks(page, "bash") for line in body.splitlines()]
    return [line for line in lines if line.startswith("minimlx ")]


DECIMAL = re.compile(r"\d+\.\d+")


def line_pattern(line: str) -> str:
    """A documented line as a regular expression: its text as it is, each decimal number also one unit of its last
    digit above or below (the rounding of a value computed with another instruction set's order of sums)."""

    def nearby(number: str) -> str:
        places = len(number.split(".")[1])
        unit, value = 10**-places, float(number)
        spellings = {f"{v:.{places}f}" for v in (value - unit, value, value + unit) if v >= 0}
        return "(?:" + "|".join(re.escape(s) for s in sorted(spellings)) + ")"

    parts = DECIMAL.split(line)
    numbers = [nearby(n) for n in DECIMAL.findall(line)] + [""]
    return "".join(re.escape(text) + number for text, number in zip(parts, numbers))


def matches(documented: list[str], actual: list[str]) -> bool:
    """The documented lines in order, where `...` matches any run of lines (`line_pattern`: decimals to their last
    digit, give or take one)."""
    pattern = "".join(r"(?:.*\n)*?" if line == "..." else line_pattern(line) + r"\n" for line in documented)
    return re.fullmatch(pattern, "".join(line + "\n" for line in actual)) is not None


def shell(command: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a documented command line in bash, with this Python's minimlx first on the PATH."""
    shim = cwd / ".bin"
    shim.mkdir(exist_ok=True)
    (shim / "minimlx").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m minimlx "$@"\n')
    (shim / "minimlx").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=timeout,
    )
