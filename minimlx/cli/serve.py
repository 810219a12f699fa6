"""`minimlx serve`: OpenAI- and Anthropic-compatible HTTP APIs over the decode engine."""

import ctypes
import ipaddress
import os
import socket
from dataclasses import replace

import click

from ..errors import InvalidSettingError
from .group import (
    chat_template_option,
    dtype_option,
    exact_option,
    image_limit_options,
    image_limits,
    kv_bits_option,
    main,
    max_kv_size_option,
    mmproj_option,
    parallel_options,
)
from .run import open_model, use_device, whole_option


def one_blas_thread() -> None:
    """Make MKL multiply on one thread unless MKL_NUM_THREADS says otherwise.

    A batched decode step is hundreds of small matmuls (a few rows each). With a second MKL thread
    each one waits for that thread to be scheduled, which on a busy machine makes batches slower and a
    lone request no faster (benchmarks/RESULTS.md).
    """
    from ..cpu import blas

    if blas.loaded and "mkl" in blas.loaded and "MKL_NUM_THREADS" not in os.environ:
        ctypes.CDLL(blas.loaded).MKL_Set_Num_Threads(1)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def freed_buffers_return() -> None:
    """Make glibc give freed buffers of 1 MB or more back to the system at once (a fixed mmap threshold).

    glibc raises its mmap threshold to the size of each mapped block that is freed (up to 32 MB), and serves
    later blocks below it from its arenas, which keep the pages. After a burst of long prompts the server's
    resident memory then stayed at its high-water mark (6.4-6.8 GB in a 10-minute soak, while MLX held 0.3 GB);
    with the threshold fixed it follows what MLX holds (benchmarks/RESULTS.md, "Soak").
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        pass


def check_address(host: str, port: int) -> None:
    """Refuse an address this process cannot listen on before the model is loaded, not after."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        reason = (e.strerror or str(e)).split(" (while")[0]
        raise InvalidSettingError(f"cannot listen on {host}:{port} ({reason}); pick another --port or --host") from None


def embedder_of(model, tokenizer, name: str, pooling: str | None):
    """The model's Embedder: with the pooling named, or the one its sentence-transformers files describe; None for a
    model with neither (it makes no embeddings)."""
    from ..embedding import Embedder, Pooling
    from ..io.resolve import resolve

    path = resolve(name)
    found = Pooling.read(path) if path.is_dir() else None
    if pooling is not None:
        found = Pooling.named(pooling, normalize=found.normalize if found is not None else True)
    return Embedder(model, tokenizer, found) if found is not None else None


def loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (an address, or the name localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def positive_option(name: str, default: float, help: str):
    """An option taking a number above 0, its default shown."""
    above_zero = click.FloatRange(min=0, min_open=True)
    return click.option(name, type=above_zero, default=default, show_default=True, help=help)


@main.command()
@click.option(
    "--model",
    "-m",
    multiple=True,
    help="Checkpoint folder, .gguf file, Hugging Face repo id or smollm2-135m; repeat it to serve several models, "
    "each loaded on the first request that names it.",
)
@mmproj_option
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    metavar="NAME=PATH",
    help="Serve the LoRA/DoRA adapter in PATH (PEFT or mlx-lm folder) as NAME, beside the base model; repeatable. A "
    "request picks it with model 'BASE:NAME' (or 'NAME'), or an 'adapter' field; rows of different adapters decode in "
    "one batch.",
)
@click.option(
    "--models-dir",
    metavar="DIR",
    multiple=True,
    help="Serve the checkpoint folders and .gguf files in DIR, and the models in the Hugging Face cache, each by "
    "its name, loaded on the first request that names it.",
)
@click.option(
    "--max-memory",
    metavar="SIZE",
    help="Most memory the loaded models' weights take (e.g. 8GB): to load another, the least recently used idle "
    "models are unloaded first (one answering requests is waited for). Default: no bound.",
)
@click.option(
    "--keep-alive",
    metavar="SECONDS",
    help="Unload a model once it has been idle this long (seconds, or 5m, 1h); Ollama's keep_alive field sets it "
    "per request. Default: models stay loaded.",
)
@click.option(
    "--allow-model",
    metavar="PATTERN",
    multiple=True,
    help="Serve only models whose name or path matches PATTERN (shell-style: 'Qwen/*', '*-0.6B'); repeatable. "
    "Requests for others are refused (403).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on.")
@whole_option("--max-batch", 8, "Most sequences decoded together; more requests wait.")
@whole_option("--max-queue", 64, "Most requests waiting for a batch slot; more are answered 429.")
@whole_option(
    "--prompt-cache", 8, "Finished conversations kept so a follow-up prefills only its new tokens; 0 keeps none.", low=0
)
@click.option(
    "--prompt-cache-bytes",
    type=click.IntRange(min=1),
    help="Most bytes the prompt cache holds (in memory, and in --prompt-cache-dir); least recently used go first.",
)
@click.option(
    "--prompt-cache-dir",
    metavar="DIR",
    help="Keep the prompt cache in DIR too, so that a restarted server reads it back.",
)
@click.option("--api-key", help="Require 'Authorization: Bearer KEY' on every /v1 request.")
@positive_option("--max-request-mb", 8, "Largest request body read; larger ones are answered 413.")
@click.option(
    "--allow-image-urls",
    is_flag=True,
    help="Fetch http(s) image URLs that requests send (else only data URLs are read). The server then reaches any "
    "address a client names: give it only where that is wanted.",
)
@positive_option("--image-url-mb", 20, "Largest image fetched from a URL; larger ones are answered 413.")
@positive_option("--image-url-timeout", 10, "Seconds an image URL may take to fetch; a slower one is answered 400.")
@click.option(
    "--served-model-name",
    help="The only model name requests may ask for (others get 404); default: any name is answered.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a request may generate; a longer one ends with finish_reason length. Default: no limit.",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=5,
    show_default=True,
    help="Seconds running requests get to finish after SIGTERM or Ctrl-C; new ones are answered 503.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    help="The most tokens an answer takes, whatever a request asks (larger asks are capped, and the answer says so). "
    "Default: the room left in the model's context.",
)
@click.option(
    "--force-tool-call",
    metavar="NAME=JSON",
    help="Answer a turn that ends with a user message, offers the tool NAME and made no call yet with exactly this "
    "call, decoded under a grammar: for testing agents with a model that would not call tools "
    '(e.g. \'Bash={"command": "ls"}\').',
)
@click.option(
    "--pooling",
    type=click.Choice(["mean", "lasttoken", "cls", "max"]),
    help="Answer /v1/embeddings and /api/embed with the model's final hidden states pooled this way (normalized). "
    "Default: the pooling of the model's sentence-transformers files, if it has them.",
)
@click.option(
    "--heartbeat",
    type=click.FloatRange(min=0, min_open=True),
    default=5,
    show_default=True,
    help="Seconds a stream may stay silent (a long prompt being read) before a keep-alive goes out: Anthropic's "
    "ping event, a comment in OpenAI's streams.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="One line per request on stderr: uvicorn's access-log style, or JSON objects for machines.",
)
@chat_template_option
@click.option(
    "--reasoning-format",
    type=click.Choice(["auto", "deepseek", "none"]),
    default="auto",
    show_default=True,
    help="auto/deepseek: thinking goes to reasoning_content; none: it stays in the content.",
)
@click.option("--device", type=click.Choice(["gpu", "cpu"]), help="Where to run; default: MLX's default.")
@dtype_option
@kv_bits_option
@max_kv_size_option
@exact_option
@image_limit_options
@click.option(
    "--image-cache-mb",
    type=click.FloatRange(min=0),
    default=256,
    show_default=True,
    help="Keep the encoder's output of the latest pictures read, within this many MB, so that a picture sent again "
    "is not encoded again; 0 keeps none.",
)
@parallel_options
def serve(
    adapters,
    host,
    port,
    models_dir,
    max_memory,
    keep_alive,
    allow_model,
    max_batch,
    max_queue,
    prompt_cache,
    prompt_cache_bytes,
    prompt_cache_dir,
    api_key,
    max_request_mb,
    served_model_name,
    request_timeout,
    shutdown_timeout,
    max_tokens,
    force_tool_call,
    pooling,
    heartbeat,
    log_format,
    chat_template,
    reasoning_format,
    image_cache_mb,
    **options,
):
    """Answer OpenAI, Anthropic and Ollama API requests over HTTP until Ctrl-C.

    Chat completions, completions, Responses and embeddings (OpenAI), Messages (Anthropic), /api/* (Ollama); one
    model, or several (--model repeated, --models-dir) loaded on demand within --max-memory.
    """
    from ..server import serve as run_server
    from ..server.models import Models, Serving
    from ..server.residency import FOREVER, Residency, byte_size, seconds
    from ..server.turns import ForcedCall

    forced_call = ForcedCall.parse(force_tool_call) if force_tool_call is not None else None
    reasoning, fetcher = reasoning_format != "none", image_urls(options)
    serving = Serving(chat_template, reasoning, request_timeout, max_tokens, forced_call, heartbeat, fetcher)
    serving = replace(serving, image_limits=image_limits(options))
    budget = byte_size(max_memory) if max_memory is not None else None
    idle = seconds(keep_alive, "--keep-alive") if keep_alive is not None else FOREVER
    engine_options = dict(max_batch=max_batch, max_queue=max_queue, prompt_cache_size=prompt_cache)
    engine_options |= engine_caches(prompt_cache_bytes, prompt_cache_dir, image_cache_mb, options)
    several = len(options["model"]) > 1 or bool(models_dir)
    folders = adapter_folders(adapters, options["parallel"], several)
    check_one_model_options(options, several)
    if options["parallel"] or not several:
        options["model"] = options["model"][0] if options["model"] else None
    if not options["parallel"] or world_rank() == 0:
        check_address(host, port)
    one_blas_thread()
    freed_buffers_return()
    loader = ModelLoader(options, engine_options, serving, pooling, per_model_folders=several, adapters=folders)
    if several:
        catalog, preloaded = several_models(options["model"], models_dir, allow_model, options), ()
        if served_model_name is not None:
            raise InvalidSettingError("--served-model-name names the one model served; models go by their names")
    else:
        served = one_model(loader, options, served_model_name)
        if served is None:  # a parallel run's other ranks follow rank 0's engine
            return
        catalog, preloaded = one_catalog(served, allow_model, served_model_name), (served,)
        startup_notes(served.engine, served.tokenizer, chat_template, prompt_cache_dir)
    names = ", ".join(known.name for known in catalog.models)
    if api_key is None and not loopback(host):
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    click.echo(f"minimlx serves {names} on http://{host}:{port}/v1 (Ctrl-C stops)", err=True)
    models = Models(catalog, loader, Residency(budget, idle), preloaded)
    run_server(
        models,
        host,
        port,
        api_key=api_key,
        max_request_mb=max_request_mb,
        shutdown_timeout=shutdown_timeout,
        log_format=log_format,
    )


def engine_caches(prompt_cache_bytes, prompt_cache_dir, image_cache_mb, options: dict) -> dict:
    """The engine's settings of what it keeps: the prompt cache's bytes and folder, the KV cache's (--kv-bits,
    --max-kv-size) and the images' soft tokens' bytes."""
    caches = dict(prompt_cache_bytes=prompt_cache_bytes, prompt_cache_dir=prompt_cache_dir)
    caches |= {name: options[name] for name in ("kv_bits", "max_kv_size")}
    return caches | dict(image_cache_bytes=int(image_cache_mb * 2**20))


def image_urls(options: dict):
    """The fetcher of http(s) image URLs that --allow-image-urls asks for (None without it), its options taken out of
    `options`."""
    from ..server.images import ImageFetcher

    allowed, megabytes, timeout = (options.pop(k) for k in ("allow_image_urls", "image_url_mb", "image_url_timeout"))
    return ImageFetcher(int(megabytes * 1e6), timeout) if allowed else None


def check_one_model_options(options: dict, several: bool) -> None:
    """The options that go with one model alone, refused with several."""
    if options["parallel"] and several:
        raise InvalidSettingError("--parallel serves one model; give one --model and no --models-dir")
    if options["mmproj"] is not None and several:
        raise InvalidSettingError("--mmproj goes with one --model; with several, each finds the mmproj*.gguf beside it")


def adapter_folders(specs: tuple[str, ...], parallel, several: bool) -> dict[str, str]:
    """--adapter's NAME=PATH options as {name: folder}, checked before the model loads."""
    if specs and parallel:
        raise InvalidSettingError("adapters are not served across processes yet; drop --parallel or --adapter")
    if specs and several:
        message = "--adapter serves adapters of the one model given; give one --model and no --models-dir"
        raise InvalidSettingError(message)
    from ..tune.serving import parse_adapter_specs

    return parse_adapter_specs(specs)


def served(model, folders: dict[str, str]):
    """The engine's `Adapters` of `folders` attached to `model`; None without any."""
    from ..tune.serving import served_adapters

    return served_adapters(model, folders) if folders else None


def world_rank() -> int:
    from ..distributed import world

    return world().rank()


class ModelLoader:
    """Loads a known model as the server runs it: its weights (--dtype), its engine (serve's engine options; with
    several models each keeps its prompt cache in a folder of its own under --prompt-cache-dir), its embedder."""

    def __init__(
        self, options: dict, engine_options: dict, serving, pooling: str | None, per_model_folders: bool, adapters=None
    ):
        self.options, self.engine_options, self.serving, self.pooling = options, engine_options, serving, pooling
        self.per_model_folders, self.adapters = per_model_folders, adapters or {}

    def engine(self, model, tokenizer, name: str):
        from ..decode import Engine

        if self.options["parallel"]:  # every rank steps the engine; rank 0 alone listens (distributed.Mirrored)
            from ..distributed import Mirrored as Engine
        engine_options = dict(self.engine_options)
        folder = engine_options["prompt_cache_dir"]
        if folder is not None and self.per_model_folders:
            engine_options["prompt_cache_dir"] = os.path.join(folder, name.replace("/", "--").replace(":", "-"))
        return Engine(model, tokenizer, **engine_options, adapters=served(model, self.adapters))

    def __call__(self, known):
        from ..loading import load
        from ..server.models import ServedModel

        model, tokenizer = load(known.path, self.options["dtype"])
        if self.serving.chat_template is not None:
            tokenizer.chat_template = self.serving.chat_template
        engine = self.engine(model, tokenizer, known.name)
        return ServedModel(engine, known, self.serving, embedder_of(model, tokenizer, known.path, self.pooling))


def one_model(loader: ModelLoader, options: dict, served_model_name: str | None):
    """The one model, loaded before the server starts (as its errors should show at once); None on the ranks of a
    parallel run other than 0, once rank 0 has stopped."""
    from ..io.resolve import DEFAULT_MODEL
    from ..server.catalog import Known, path_of
    from ..server.models import ServedModel

    model, tokenizer = open_model(options)
    name = options["model"] or DEFAULT_MODEL
    engine = loader.engine(model, tokenizer, name)
    if options["parallel"] and engine.rank != 0:
        engine.follow()
        return None
    known = Known(served_model_name or name, served_model_name or name, path_of(name))
    return ServedModel(engine, known, loader.serving, embedder_of(model, tokenizer, name, loader.pooling))


def one_catalog(served, allow: tuple[str, ...], served_model_name: str | None):
    from ..server.catalog import Catalog

    catalog = Catalog([served.known], allow, any_name=served_model_name is None)
    if not catalog.models:
        raise InvalidSettingError(f"the model {served.name} does not match --allow-model {' '.join(allow)}")
    return catalog


def several_models(given: tuple[str, ...], folders: tuple[str, ...], allow: tuple[str, ...], options: dict):
    """The catalog of several models: those given (found, or downloaded, now), then the folders', then the Hugging
    Face cache's."""
    from pathlib import Path

    from ..io.resolve import resolve
    from ..server import catalog

    use_device(options)
    known = [catalog.given(name, resolve(name)) for name in given]
    for folder in folders:
        if not Path(folder).is_dir():
            raise InvalidSettingError(f"--models-dir {folder} is not a folder; give the folder that holds the models")
        known += catalog.in_folder(Path(folder))
    known += catalog.in_hub_cache() if folders else []
    found = catalog.Catalog(known, allow)
    if not found.models:
        where = ", ".join([*given, *folders]) or "the Hugging Face cache"
        raise InvalidSettingError(f"no model to serve in {where}" + (" matches --allow-model" if allow else ""))
    return found


def startup_notes(engine, tokenizer, chat_template, prompt_cache_dir) -> None:
    """What the operator should know of the one model before the first request: the prompts read back from
    `prompt_cache_dir`, a model without a chat template and none given."""
    if prompt_cache_dir is not None:
        entries = engine.prompt_cache.entries
        held = sum(c.nbytes for _, cache in entries for c in cache)
        click.echo(f"prompt cache: {len(entries)} prompts ({held / 1e6:.1f} MB) read from {prompt_cache_dir}", err=True)
    if chat_template is None and tokenizer is not None and tokenizer.chat_template is None:
        click.echo(
            "warning: this model has no chat template, so chat requests (chat completions, Responses, Messages) "
            "are refused; give one with --chat-template FILE, or send raw text to /v1/completions",
            err=True,
        )
