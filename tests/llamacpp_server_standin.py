"""Stands in for `llama-server` under llama.cpp's own server tests: their `utils.ServerProcess.start` runs
`$LLAMA_SERVER_BIN_PATH` with llama-server's flags; this maps those to `python -m minimlx serve` and becomes it
(exec, so that the tests' terminate() stops the server itself).

Whatever model flags say, SmolLM2-135M (the pip-installed GGUF) is served: the tests' hub models are never
downloaded.
A flag in none of the tables below ends the stand-in with an error naming it, so that a test needing a
llama-server feature minimlx lacks fails saying so.
"""

import os
import sys

MODEL = ["-m", "smollm2-135m"]
MODEL_FLAGS = {"--model", "--hf-repo", "--hf-file"}
# llama-server flag -> minimlx serve option taking the same value.
RENAMED = {
    "--port": "--port",
    "--host": "--host",
    "--api-key": "--api-key",
    "--parallel": "--max-batch",
    "--chat-template-file": "--chat-template",
    "--reasoning-format": "--reasoning-format",
}
# Flags with a value that minimlx serve has no equivalent for: defaults requests override (--temp, --seed,
# --n-predict), llama.cpp memory/threading knobs, and --chat-template, which names llama.cpp's built-in
# templates (chatml, llama3, command-r) or holds a template inline: minimlx uses the model's Jinja template.
IGNORED = {"--temp", "--seed", "--n-predict", "--ctx-size", "--batch-size", "--ubatch-size", "--threads"}
IGNORED |= {"--n-gpu-layers", "--chat-template"}
# --alias only names the model in llama-server's answers: a one-model llama-server answers any `model` a request
# names (their tests send "test", "gpt-4.1", ...), as minimlx serve does without --served-model-name.
IGNORED |= {"--alias"}
# Switches of llama.cpp alone: minimlx always renders Jinja templates, has no slots endpoint or web UI, and
# never downloads here.
SWITCHES = {"--jinja", "--no-jinja", "--slots", "--no-slots", "--offline", "--cont-batching", "--no-ui", "--verbose"}


def serve_args(argv: list[str]) -> list[str]:
    """llama-server's arguments -> `minimlx serve`'s."""
    args, rest = [*MODEL], iter(argv)
    for flag in rest:
        if flag in SWITCHES:
            continue
        if flag not in MODEL_FLAGS | RENAMED.keys() | IGNORED:
            raise SystemExit(f"error: llama-server's {flag} has no minimlx serve equivalent (llamacpp_server_standin)")
        value = next(rest, None)
        if value is None:
            raise SystemExit(f"error: llama-server's {flag} needs a value (llamacpp_server_standin)")
        if flag in RENAMED:
            args += [RENAMED[flag], value]
    return args


if __name__ == "__main__":
    command = [sys.executable, "-m", "minimlx", "serve", *serve_args(sys.argv[1:])]
    print("llamacpp_server_standin:", " ".join(command), file=sys.stderr, flush=True)
    os.execv(sys.executable, command)
