"""README.md, docs/anatomy.md and docs/python-api.md run as written: their commands exit with status 0 and
print what the page shows, their `>>>` sessions give the results shown, their programs print what follows
them (see doc_pages.py for what counts as what). docs/cli.md has its own test, test_docs_cli.py."""

import contextlib
import doctest
import io

import mlx.core as mx
import pytest
from doc_pages import ROOT, bash_commands, blocks, console_commands, matches, shell
from models import smollm2_path

PAGES = ["README.md", "docs/anatomy.md", "docs/python-api.md"]
COMMANDS = [(page, command, output) for page in PAGES for command, output in console_commands(ROOT / page)]
COMMANDS += [(page, command, None) for page in PAGES for command in bash_commands(ROOT / page)]
KNOWN = {}  # documented output that differs here, for a reason outside the page: command -> why (xfail until fixed)
PROGRAMS = [
    (page, body, after)
    for page in PAGES
    for body, _, after in blocks(ROOT / page, "python")
    if body.startswith(("import ", "from ")) and ">>> " not in body and "path/to" not in body
]
SESSIONS = [page for page in PAGES if any(">>> " in body for body, _, _ in blocks(ROOT / page, "python"))]


def test_every_page_has_something_to_run():
    assert {page for page, *_ in COMMANDS + PROGRAMS} | set(SESSIONS) == set(PAGES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, command, output",
    [
        pytest.param(
            *case,
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN[case[1]])] if case[1] in KNOWN else [],
            id=f"{case[0]}: {case[1]}",
        )
        for case in COMMANDS
    ],
)
def test_documented_command_runs_as_written(page, command, output, tmp_path):
    smollm2_path()
    run = shell(command.replace("minimlx chat", "minimlx chat < /dev/null"), tmp_path)
    assert run.returncode == 0, run.stdout
    if output is not None:
        actual = [line.rstrip() for line in run.stdout.rstrip("\n").split("\n")]
        assert matches(output, actual), "\n".join(["documented:", *output, "actual:", *actual])


@pytest.mark.slow
@pytest.mark.parametrize("page, program, output", PROGRAMS, ids=[f"{p}: {b.splitlines()[-1]}" for p, b, _ in PROGRAMS])
def test_documented_program_prints_what_the_page_shows(page, program, output):
    smollm2_path()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(program, page, "exec"), {})
    if output:
        assert printed.getvalue().rstrip("\n").splitlines() == output.rstrip("\n").splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("page", SESSIONS)
def test_documented_session_gives_the_results_shown(page):
    smollm2_path()
    source = "\n".join(body for body, _, _ in blocks(ROOT / page, "python") if ">>> " in body)
    names = {"__name__": "docs", "mx": mx}
    with contextlib.redirect_stdout(io.StringIO()):  # the page's programs before the session: loading the model
        for program in (body for p, body, _ in PROGRAMS if p == page):
            exec(compile(program, page, "exec"), names)
    test = doctest.DocTestParser().get_doctest(source, names, page, page, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report = io.StringIO()
    runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()
