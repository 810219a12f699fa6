"""The `minimlx` command group, and the options, checks and helpers its subcommands share."""

import os
import sys
import warnings

import click

from ..errors import InvalidSettingError, MinimlxError


def fail(message: str, status: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(status)


class Group(click.Group):
    """Ends every failure with one line on stderr and a non-zero status, never a traceback: user errors and
    usage errors exit 2, an interrupt 130, a failed read or write (closed pipe, full disk) 1. Warnings are
    one line each."""

    def main(self, args=None, prog_name=None, **extra):
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *where, **how: click.echo(f"warning: {message}", err=True)
            try:
                if sys.stdout is None:
                    raise InvalidSettingError("standard output is closed; redirect it to a file or /dev/null")
                status = super().main(args, prog_name, standalone_mode=False, **extra)
            except MinimlxError as e:
                fail(str(e), 2)
            except click.exceptions.NoArgsIsHelpError as e:  # `minimlx` alone: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            except click.ClickException as e:
                fail(e.format_message(), e.exit_code)
            except (click.Abort, KeyboardInterrupt):
                fail("interrupted", 130)
            except RuntimeError as e:  # under --pipeline/--tensor-parallel: another rank died
                from ..distributed import peer_lost

                if (message := peer_lost(e)) is None:
                    raise
                fail(message, 1)
        sys.exit(status or 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as e:  # a closed pipe or a full disk (caught here: click would end a closed pipe silently)
            silence_stdout()  # what is left of the output cannot be written either
            fail(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""), 1)


def cpu_notes() -> None:
    """On the CPU, say what makes this machine slower than it could be, one line each: MLX's reference BLAS under
    the float32 matmuls, no native kernel."""
    import mlx.core as mx

    from ..cpu import blas, native

    if mx.default_device() == mx.cpu:
        for note in (blas.advice(), native.note):
            if note:
                click.echo(note, err=True)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no stdout, or one without a file descriptor
        pass


def clean(text: str, where: str) -> str:
    """`text` with invalid UTF-8 (which Python keeps as lone surrogates) replaced by U+FFFD, said once on stderr."""
    fixed = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if fixed != text:
        warnings.warn(
            f"{where} is not valid UTF-8; the invalid bytes were replaced by \N{REPLACEMENT CHARACTER}", stacklevel=2
        )
    return fixed


class Text(click.ParamType):
    """A text argument: invalid UTF-8 replaced (with a warning), as `clean` does."""

    name = "text"

    def convert(self, value, param, ctx):
        return clean(value, f"the {param.human_readable_name.lower()} argument")


TEXT = Text()


def read_stdin() -> str:
    """All of stdin as text (invalid UTF-8 replaced, with a warning), without the newline echo and heredocs add."""
    if sys.stdin is None:
        raise InvalidSettingError("standard input is closed; pass the prompt as an argument")
    sys.stdin.reconfigure(errors="surrogateescape")
    return clean(sys.stdin.read(), "standard input").rstrip("\n")


dtype_option = click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16", "quantized"]),
    help="Execution dtype (default on the CPU: packed weights on the native kernel where it is installed and reads "
    "them, the rest float32; on a GPU: as stored); quantized keeps packed weights (MLX folders, GGUF) packed.",
)
"""The `--dtype` option of every command that loads a model."""

mmproj_option = click.option(
    "--mmproj",
    metavar="FILE",
    help="With a .gguf text file: llama.cpp's mmproj file of its vision tower, for images (default: the one "
    "mmproj*.gguf beside the text file that fits it, if any).",
)
"""The `--mmproj` option of the commands that load a model to generate (run, chat, serve), as llama.cpp's."""

inspected_adapter_option = click.option(
    "--adapter",
    metavar="PATH",
    help="Look inside the model with this adapter (PEFT's or mlx-lm's folder) applied; `minimlx adapter-effect` "
    "compares it with the base.",
)
"""The `--adapter` option of the commands that show a model's inner numbers (lens, attention, compare)."""

kv_bits_option = click.option(
    "--kv-bits",
    type=click.Choice(["8", "4"]),
    callback=lambda _context, _option, value: int(value) if value else None,
    help="Hold the KV cache quantized to 8 or 4 bits (a quarter or an eighth of float32's bytes; attention reads "
    "the codes); default: the model's dtype.",
)
"""The `--kv-bits` option of the commands that generate (run, chat, serve, bench)."""

max_kv_size_option = click.option(
    "--max-kv-size",
    type=click.IntRange(min=5),
    help="Keep at most N tokens in the KV cache: the first 4 (attention sinks) and the latest, so that a long "
    "text stays in bounded memory; default: all.",
)
"""The `--max-kv-size` option of the commands that generate (run, chat, serve, bench)."""


def image_limit_options(command):
    """The options that bound a prompt's pictures (run, chat, serve): `image_limits` reads them."""
    options = [
        click.option(
            "--max-image-pixels",
            type=click.IntRange(min=1),
            help="Refuse a picture of more pixels than N (read from its header, before decoding); default: 8192 x 8192",
        ),
        click.option(
            "--max-image-mb",
            type=click.FloatRange(min=0, min_open=True),
            help="Refuse a picture file larger than this many MB; default: 20.",
        ),
        click.option(
            "--max-images", type=click.IntRange(min=1), help="Refuse a prompt of more pictures than N; default: 16."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def image_limits(options: dict):
    """The `ImageLimits` of the image limit options (taken out of `options`)."""
    from ..vision import ImageLimits

    return ImageLimits.of(options.pop("max_image_pixels"), options.pop("max_image_mb"), options.pop("max_images"))


def keep_float_products(_context, _option, exact: bool) -> None:
    if exact:
        from ..cpu import native

        native.exact_products = True


exact_option = click.option(
    "--exact",
    is_flag=True,
    expose_value=False,
    callback=keep_float_products,
    help="On the CPU's native kernel, keep decode steps' inputs in float32 (default: quantized to 8 bits per block "
    "of 32 for integer dot products, as llama.cpp does: faster decoding, and a greedy token now and then "
    "other than float32's).",
)
"""The `--exact` option of the commands that generate (run, chat, serve, bench)."""


def read_template(context, parameter, path: str | None) -> str | None:
    """The text of a --chat-template file, or a one-line error naming it."""
    if path is None:
        return None
    try:
        return open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise InvalidSettingError(f"cannot read the chat template {path} ({reason}); give a Jinja file") from None


chat_template_option = click.option(
    "--chat-template",
    metavar="FILE",
    callback=read_template,
    help="A Jinja chat template file used instead of the model's own.",
)


def inspection_dtype(dtype: str | None) -> str | None:
    """The dtype of the commands that show a model's inner numbers (lens, attention, compare): float32 on the CPU
    unless `--dtype` says otherwise, the checkpoint's weights dequantized exactly, so that their tables match a
    float reference and read the same on every CPU (the native kernel's packed products sum in the order of the
    instruction set it runs)."""
    import mlx.core as mx

    return dtype or ("float32" if mx.default_device() == mx.cpu else None)


def parallel_options(command):
    """`--pipeline` / `--tensor-parallel` of every command that loads a model: this process is one rank of those
    `mlx.launch` started, holding its part of the model (see docs/distributed.md)."""
    command = click.option(
        "--tensor-parallel",
        "parallel",
        flag_value="tensor",
        help="Under mlx.launch: each rank holds part of every layer (heads, FFN columns, experts).",
    )(command)
    return click.option(
        "--pipeline", "parallel", flag_value="pipeline", help="Under mlx.launch: each rank holds a range of layers."
    )(command)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="minimlx")
def main():
    """Run transformer language models with MLX and look inside them."""
