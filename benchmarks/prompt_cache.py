"""Time to the first token after a long system prompt: prefilled cold, or read from a saved prompt cache file.

    python benchmarks/prompt_cache.py [--model smollm2-135m] [--prefix-tokens 2000] [--rounds 3]

The system prompt is benchmarks/workloads/rewrite.txt repeated and cut at `--prefix-tokens` tokens, the question a
short one after it. `minimlx cache-prompt` saves the system prompt's cache once per KV cache kind (float, and
`--kv-bits 8`); each round then times, in this process and with the model loaded, a cold answer (the whole prompt
prefilled) and an answer from the file (`load_prompt_cache`, reading the file included, then the question's
tokens prefilled), interleaved so that a busy machine slows both alike. The table shows medians over rounds and
the ratio to the cold run's time in each round. The file was just written, so it is read from the page cache.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import minimlx
from minimlx.decode.prompt import encode_prefix

WORKLOAD = Path(__file__).parent / "workloads" / "rewrite.txt"
QUESTION = "In one sentence, what is the text about?"


def first_token_seconds(model, tokenizer, system: str, **options) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, prompt tokens the file supplied) of a greedy answer."""
    start = time.perf_counter()
    if "prompt_cache" in options:
        options["prompt_cache"] = minimlx.load_prompt_cache(options["prompt_cache"], model, tokenizer)
    response = next(iter(minimlx.stream_generate(model, tokenizer, QUESTION, system=system, max_tokens=1, **options)))
    return time.perf_counter() - start, response.prompt_tokens, response.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = minimlx.load(args.model)
    text = WORKLOAD.read_text()
    words = tokenizer.encode("\n\n".join([text] * (args.prefix_tokens // 100 + 1)), add_special_tokens=False)
    system = tokenizer.decode(words[: args.prefix_tokens])
    folder = Path(tempfile.mkdtemp())
    files = {}
    for kv_bits in (None, 8):
        files[kv_bits] = folder / f"system-{kv_bits or 'float'}.safetensors"
        ids = encode_prefix(tokenizer, "", system=system)
        minimlx.save_prompt_cache(files[kv_bits], model, tokenizer, ids, kv_bits=kv_bits)
        first_token_seconds(model, tokenizer, system, kv_bits=kv_bits, prompt_cache=files[kv_bits])  # warm-up
    cold = {kv_bits: [] for kv_bits in files}
    saved = {kv_bits: [] for kv_bits in files}
    for round_ in range(args.rounds):
        for kv_bits, path in files.items():
            cold[kv_bits].append(first_token_seconds(model, tokenizer, system, kv_bits=kv_bits))
            saved[kv_bits].append(first_token_seconds(model, tokenizer, system, kv_bits=kv_bits, prompt_cache=path))
            print(
                f"round {round_ + 1}, {kv_bits or 'float'}: cold {cold[kv_bits][-1][0]:.3f} s, "
                f"from the file {saved[kv_bits][-1][0]:.3f} s",
                file=sys.stderr,
            )
    prompt, cached = saved[None][0][1:]
    print(
        f"{args.model}, time to the first token of a {prompt}-token prompt whose first {cached} tokens (a system "
        f"prompt) are in a prompt cache file; median of {args.rounds} interleaved rounds\n"
    )
    print("| KV cache | file | cold prefill | from the file | ratio (per-round) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kv_bits, path in files.items():
        ratios = [s[0] / c[0] for s, c in zip(saved[kv_bits], cold[kv_bits])]
        print(
            f"| {f'{kv_bits}-bit' if kv_bits else 'float'} | {path.stat().st_size / 1e6:.1f} MB "
            f"| {statistics.median(c[0] for c in cold[kv_bits]):.3f} s "
            f"| {statistics.median(s[0] for s in saved[kv_bits]):.3f} s | {statistics.median(ratios):.3f}x |"
        )


if __name__ == "__main__":
    main()
