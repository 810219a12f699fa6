"""How closely decoding with the native kernel's integer products follows float32 inputs, on SmolLM2's Q4_1 GGUF
(or `--model`, e.g. benchmarks/synthetic_gguf.py's 1.1B LLaMA-shaped Q4_K_M).

For each prompt: a greedy run of N tokens with float32 inputs (`MINIMLX_NATIVE_PRODUCTS=float`'s path), then the
same tokens fed through the integer products' decode steps (teacher-forced, so one flipped token does not change
every later comparison). Printed per prompt: the share of positions whose greedy token is the same, the largest
and the median difference of the logits, and the largest relative (norm) difference; then where a free-running
integer decode first leaves the float text.

    python benchmarks/integer_products.py --tokens 512
    python benchmarks/integer_products.py --tokens 512 --prompts 4 --model /tmp/kq-bench/llama1b-Q4_K_M.gguf
"""

import argparse
import statistics

from minimlx import load  # first: its BLAS must be loaded before mlx.core  # isort: skip
import mlx.core as mx

from minimlx.core.steps import decode_steps
from minimlx.cpu import native
from minimlx.decode.prompt import encode_prompt
from minimlx.errors import MinimlxError

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "List five facts about the planet Mars.",
    "What are the benefits of learning a second language?",
    "Describe a busy market in the morning.",
    "Give me a recipe for pancakes.",
]


def step(model, cache, ids: list[int], exact: bool) -> mx.array:
    """Logits (vocab,) of the last of `ids`, fed as a decode step (one token) or a prompt."""
    native.exact_products = exact
    feed = mx.array([ids])
    if len(ids) == 1:
        with decode_steps():
            logits = model(feed, cache, last_only=True)[0, -1]
    else:
        logits = model(feed, cache, last_only=True)[0, -1]
    mx.eval(logits)
    return logits


def compare(model, prompt: list[int], tokens: int) -> dict:
    float_cache, integer_cache = model.make_cache(), model.make_cache()
    floats, integers = step(model, float_cache, prompt, True), step(model, integer_cache, prompt, False)
    same, differences, relative = 0, [], []
    for _ in range(tokens):
        token = mx.argmax(floats).item()
        same += mx.argmax(integers).item() == token
        differences.append(mx.abs(integers - floats).max().item())
        relative.append((mx.linalg.norm(integers - floats) / mx.linalg.norm(floats)).item())
        floats, integers = step(model, float_cache, [token], True), step(model, integer_cache, [token], False)
    median = statistics.median(differences)
    return {"same": same, "largest": max(differences), "median": median, "relative": max(relative)}


def greedy(model, prompt: list[int], tokens: int, exact: bool) -> list[int]:
    cache = model.make_cache()
    logits, out = step(model, cache, prompt, True), []
    for _ in range(tokens):
        out.append(mx.argmax(logits).item())
        logits = step(model, cache, out[-1:], exact)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file (default: SmolLM2-135M's Q4_1)")
    args = parser.parse_args()
    try:
        model, tokenizer = load(args.model)
    except MinimlxError as e:
        parser.error(f"--model {args.model}: {e}")
    shown = "SmolLM2-135M Q4_1 GGUF" if args.model == "smollm2-135m" else args.model
    print(f"{shown} on the native kernel ({native.kernel.integer_isa} integer products),")
    print(f"{args.tokens} greedy tokens per prompt, teacher-forced on the float32 path's tokens\n")
    print("| prompt | same greedy token | largest logit difference | median | largest relative | free run parts at |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    total = 0
    for text in PROMPTS[: args.prompts]:
        ids = encode_prompt(tokenizer, text)
        r = compare(model, ids, args.tokens)
        total += r["same"]
        free = greedy(model, ids, args.tokens, True), greedy(model, ids, args.tokens, False)
        first = next((i for i, (a, b) in enumerate(zip(*free)) if a != b), None)
        print(
            f"| {text[:40]} | {r['same']}/{args.tokens} ({r['same'] / args.tokens:.1%}) | {r['largest']:.3f} | "
            f"{r['median']:.3f} | {r['relative']:.2e} | {'never' if first is None else f'token {first}'} |"
        )
    count = args.tokens * min(args.prompts, len(PROMPTS))
    print(f"\nall prompts: {total}/{count} ({total / count:.2%}) the same greedy token")


if __name__ == "__main__":
    main()
