"""The chunked prefill of Gated DeltaNet against its token-by-token recurrence, on the same prompt.

    python benchmarks/recurrent_prefill.py [--tokens 512] [--rounds 3]

One Gated DeltaNet layer of Qwen3.5-0.8B's shape (width 1024, 16 key and 16 value heads of 128, a convolution of 4)
with random weights reads a prompt of --tokens tokens two ways: in one pass (the chunked delta rule, 64 tokens a
chunk: a chunk's updates condensed into matrix products) and one token at a time through its `RecurrentCache` (the
recurrent form a decode step runs). Both end in the same state; the script checks that, then prints the medians over
--rounds interleaved rounds and the ratio (chunked tokens/s over token-by-token tokens/s).
"""

import argparse  # noqa: I001  (minimlx before mlx.core: it loads the best BLAS first)
import statistics
import time

import minimlx  # noqa: F401
import mlx.core as mx
import numpy as np

from minimlx.core import RecurrentCache
from minimlx.core.recurrent import GatedDeltaNet

WIDTH, HEADS, HEAD_DIMS, KERNEL = 1024, 16, 128, 4


def layer() -> GatedDeltaNet:
    net = GatedDeltaNet(WIDTH, HEADS, HEADS, HEAD_DIMS, HEAD_DIMS, KERNEL, 1e-6)
    mx.random.seed(0)
    conv = net.conv1d.weight
    net.update({"A_log": mx.random.uniform(-1, 1, (HEADS,)), "dt_bias": mx.random.uniform(-1, 1, (HEADS,))})
    net.conv1d.update({"weight": mx.random.normal(conv.shape) * 0.5})
    mx.eval(net.parameters())
    return net


def chunked(net: GatedDeltaNet, x: mx.array) -> tuple[float, RecurrentCache]:
    cache = RecurrentCache()
    start = time.perf_counter()
    mx.eval(net(x, cache), cache.state)
    return time.perf_counter() - start, cache


def stepwise(net: GatedDeltaNet, x: mx.array) -> tuple[float, RecurrentCache]:
    cache = RecurrentCache()
    start = time.perf_counter()
    for t in range(x.shape[1]):
        mx.eval(net(x[:, t : t + 1], cache), cache.state)
    return time.perf_counter() - start, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    net = layer()
    x = mx.random.normal((1, args.tokens, WIDTH)) * 0.5
    mx.eval(x)
    chunked(net, x[:, :64])  # warm-up of both forms
    stepwise(net, x[:, :4])
    times = {"chunked": [], "token by token": []}
    for _ in range(args.rounds):
        seconds, whole = chunked(net, x)
        times["chunked"].append(seconds)
        seconds, steps = stepwise(net, x)
        times["token by token"].append(seconds)
    a, b = (np.array(c.recurrent) for c in (whole, steps))
    error = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    rates = {form: args.tokens / statistics.median(seconds) for form, seconds in times.items()}
    for form, rate in rates.items():
        print(f"{form:>15}: {rate:9.1f} tok/s (median of {args.rounds})")
    print(
        f"states agree within {error:.1e} (relative); chunked / token by token = "
        f"{rates['chunked'] / rates['token by token']:.1f}x"
    )


if __name__ == "__main__":
    main()
