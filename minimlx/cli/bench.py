"""`minimlx bench MODEL`: how fast this machine loads a model, reads a prompt and writes tokens."""

import json
import random
import resource
import statistics
import sys
import time

import click
import mlx.core as mx
from mlx.utils import tree_flatten

from ..cpu import blas, native
from ..decode import Engine, Generation, Request, SamplingSettings
from ..decode.speculative import check_speculation
from ..errors import InvalidSettingError
from ..loading import default_dtype, load
from .group import cpu_notes, dtype_option, exact_option, kv_bits_option, main, max_kv_size_option, parallel_options
from .run import speculation_options, whole_option


def timed_generation(engine: Engine, prompt: list[int], gen_tokens: int) -> tuple[float, float, Generation]:
    """(seconds to the first token, seconds from the first to the last, the generation) of a greedy run of exactly
    `gen_tokens` tokens on a fresh cache (left on `generation.cache`); end-of-sequence ids do not stop it."""
    settings = SamplingSettings(max_tokens=gen_tokens)
    generation = engine.submit(Request(prompt, settings, stop_ids=frozenset(), cache=engine.make_cache()))
    start = time.perf_counter()
    while not generation.tokens:
        engine.step()
    first = time.perf_counter()
    engine.run()
    return first - start, time.perf_counter() - first, generation


def peak_rss_gb() -> float:
    """This process's peak resident memory. On Linux its own high-water mark (VmHWM): `ru_maxrss` keeps the peak
    of the process that started this one across exec, so a benchmark's child would report its parent's."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024 / 1e9
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1e9 if sys.platform == "darwin" else 1e6)


@main.command()
@click.argument("model")
@whole_option("--prompt-tokens", 128, "Length of the prompt (random token ids, no chat template).")
@whole_option("--gen-tokens", 64, "Tokens generated per run, end-of-sequence ignored.", low=2)
@whole_option("--repeats", 3, "Measured runs after one warm-up; the figures are their medians.")
@dtype_option
@kv_bits_option
@max_kv_size_option
@exact_option
@whole_option("--prefill-step", 512, "Prompt tokens per prefill chunk.")
@click.option("--eager", is_flag=True, help="Decode without the compiled step (to compare).")
@speculation_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@parallel_options
def bench(
    model,
    prompt_tokens,
    gen_tokens,
    repeats,
    dtype,
    kv_bits,
    max_kv_size,
    prefill_step,
    eager,
    draft_model,
    draft_tokens,
    prompt_lookup,
    as_json,
    parallel,
):
    """Measure load time, prefill and decode tokens/s, time to first token and peak memory of MODEL.

    Decode tok/s counts the tokens generated, so with speculation it is the effective rate; the share of
    drafted tokens the model accepted is reported beside it.
    """
    check_speculation((draft_model is not None) + bool(prompt_lookup))
    if parallel:
        from ..distributed import rank_zero_speaks

        rank_zero_speaks()
    cpu_notes()
    start = time.perf_counter()
    net, tokenizer = load(model, dtype, parallel)
    load_s = time.perf_counter() - start
    check_fits(net, prompt_tokens, gen_tokens)
    rng = random.Random(0)
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(prompt_tokens)]
    draft = load(draft_model, dtype)[0] if draft_model is not None else None
    engine = Engine(
        net,
        max_batch=1,
        prefill_step=prefill_step,
        draft_model=draft,
        draft_tokens=draft_tokens,
        prompt_lookup=prompt_lookup,
        compiled=not eager,
        kv_bits=kv_bits,
        max_kv_size=max_kv_size,
    )
    timed_generation(engine, prompt, min(gen_tokens, 4))
    runs = [timed_generation(engine, prompt, gen_tokens) for _ in range(repeats)]
    ttft = statistics.median(first for first, _, _ in runs)
    decode = statistics.median(rest for _, rest, _ in runs)
    drafted, accepted = sum(g.drafted for _, _, g in runs), sum(g.accepted for _, _, g in runs)
    weights = tree_flatten(net.parameters())
    result = {
        "load_s": load_s,
        "prefill_tps": prompt_tokens / ttft,
        "decode_tps": (gen_tokens - 1) / decode,
        "ttft_s": ttft,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "weights_gb": sum(w.nbytes for _, w in weights) / 1e9,
        "peak_rss_gb": peak_rss_gb(),
        "dtype": dtype or default_dtype() or ("native-kernel" if mx.default_device() == mx.cpu else "as stored"),
        "device": str(mx.default_device()),
        "blas": blas.loaded,
        "compiled": engine.compiled,
        "exact_products": native.exact_products,
        "kv_bits": kv_bits,
        "max_kv_size": max_kv_size,
        "kv_cache_gb": sum(c.nbytes for c in runs[-1][2].cache) / 1e9,
        "acceptance": accepted / drafted if drafted else None,
    }
    if as_json:
        click.echo(json.dumps(result))
        return
    echo_result(model, result, prompt_tokens, gen_tokens, repeats)
    if engine.drafter is not None:
        click.echo(f"speculation: {accepted} of {drafted} drafted tokens accepted ({result['acceptance'] or 0:.0%})")


def check_fits(net, prompt_tokens: int, gen_tokens: int) -> None:
    """Refuse a prompt and answer longer together than the model's context, before any is generated."""
    context = getattr(net.config, "max_positions", None)
    if context is not None and prompt_tokens + gen_tokens > context:
        raise InvalidSettingError(
            f"--prompt-tokens {prompt_tokens} plus --gen-tokens {gen_tokens} do not fit in the model's context of "
            f"{context} positions; ask for at most {context} in all"
        )


def echo_result(model: str, result: dict, prompt_tokens: int, gen_tokens: int, repeats: int) -> None:
    """`bench`'s figures as two lines of text: the weights and where they ran, then the timings."""
    click.echo(
        f"{model}: {result['dtype']} weights {result['weights_gb']:.3f} GB on {result['device']}, "
        f"BLAS {result['blas'] or 'as MLX ships it'}"
    )
    kv_bits = result["kv_bits"]
    click.echo(
        f"load {result['load_s']:.2f} s | prefill {result['prefill_tps']:.1f} tok/s ({prompt_tokens} tokens) | "
        f"decode {result['decode_tps']:.1f} tok/s ({gen_tokens} tokens) | first token {result['ttft_s']:.3f} s | "
        f"peak memory {result['peak_memory_gb']:.3f} GB | KV cache {result['kv_cache_gb']:.4f} GB "
        f"({f'{kv_bits}-bit' if kv_bits else 'float'}) (median of {repeats})"
    )
