"""`minimlx cache-prompt`: read a prompt once and save its KV cache to a file that `run` and `chat` start from
(`--prompt-cache-file`), so that a long system prompt or document is prefilled once, not at every start."""

import click

from ..errors import InvalidSettingError
from .group import TEXT, chat_template_option, dtype_option, kv_bits_option, main, read_stdin
from .run import open_model, read_text_file, whole_option


@main.command("cache-prompt")
@click.argument("out")
@click.option("--model", "-m", help="Checkpoint folder, .gguf file, Hugging Face repo id or smollm2-135m.")
@click.option("--prompt", type=TEXT, help="The text to cache, as the start of a user turn ('-': read it from stdin).")
@click.option("--prompt-file", metavar="FILE", help="Read the text to cache from FILE.")
@click.option("--system", type=TEXT, help="A system prompt, cached before the text (or alone).")
@chat_template_option
@click.option("--no-chat-template", is_flag=True, help="Cache the text as raw text (completion).")
@click.option("--device", type=click.Choice(["gpu", "cpu"]), help="Where to run; default: MLX's default.")
@dtype_option
@kv_bits_option
@whole_option("--prefill-step", 512, "Prompt tokens per prefill chunk.")
def cache_prompt(out, prompt, prompt_file, system, no_chat_template, prefill_step, **options):
    """Read a prompt once and save its KV cache to OUT (safetensors) for --prompt-cache-file."""
    if prompt is not None and prompt_file is not None:
        raise InvalidSettingError("--prompt and --prompt-file both give the text; give one of them")
    text = read_stdin() if prompt == "-" else read_text_file("--prompt-file", prompt_file) if prompt_file else prompt
    if not (text or "").strip() and system is None:
        raise InvalidSettingError("nothing to cache; give --prompt TEXT, --prompt-file FILE or --system TEXT")
    from ..decode.prompt import encode_prefix
    from ..decode.prompt_cache import save_prompt_cache

    model, tokenizer = open_model(options)
    ids = encode_prefix(tokenizer, text or "", not no_chat_template, system)
    size = save_prompt_cache(out, model, tokenizer, ids, kv_bits=options["kv_bits"], prefill_step=prefill_step)
    click.echo(f"wrote {out}: {len(ids)} tokens, {size / 1e6:.1f} MB")
