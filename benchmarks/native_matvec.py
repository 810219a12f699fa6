"""The native kernel's packed products for decode: float32 inputs against 8-bit-quantized inputs with integer dot
products, per product and over a whole decode.

    python benchmarks/native_matvec.py [--repeats 200] [--rounds 3] [--rows 1,2,4,8,16,27] [--scales float16]
                                       [--no-decode]

Products: SmolLM2-135M's shapes (attention q/o 576 x 576 and k/v 192 x 576, the fused gate/up SwiGLU 2 x 1536 x 576,
the down projection 576 x 1536: 4-bit, groups of 32; the tied head 49,152 x 576 at 8 bits), scales and biases in
float16 as the GGUF model holds them (--scales float32: as `mx.quantize` gives them), for 1 input row (a decode step)
and for the few rows of a batched step (--rows: up to 27, where the kernel hands over to the float GEMM), with
`exact=True` (float32 inputs) and without (integer products); at one row also float32 BLAS on the dequantized weight
and MLX's `quantized_matmul`. Medians over repeats, the paths interleaved, so that a busy machine slows all alike.

Decode: `minimlx bench smollm2-135m` (128-token prompt, 64 generated tokens, compiled step) with
MINIMLX_NATIVE_PRODUCTS=float and =integer, one process each per round, rounds interleaved; medians of the rounds.
"""

import argparse  # noqa: I001  (minimlx before mlx.core: it loads the best BLAS first)
import json
import os
import statistics
import subprocess
import sys
import time

import minimlx  # noqa: F401
import mlx.core as mx
import minimlx_native

SHAPES = {  # name: (output rows, input features, bits, products fused)
    "attention q, o": (576, 576, 4, 1),
    "attention k, v": (192, 576, 4, 1),
    "FFN gate + up (SwiGLU)": (1536, 576, 4, 2),
    "FFN down": (576, 1536, 4, 1),
    "tied head": (49152, 576, 8, 1),
}


def timed(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def products(name: str, shape, rows: int, repeats: int, scales_dtype) -> None:
    out_dims, in_dims, bits, fused = shape
    mx.random.seed(0)
    weights = []
    for _ in range(fused):
        w, scales, biases = mx.quantize(mx.random.normal((out_dims, in_dims)), 32, bits)
        weights.append((w, scales.astype(scales_dtype), biases.astype(scales_dtype)))
    x = mx.random.normal((rows, in_dims))
    mx.eval(weights, x)

    def kernel(exact: bool):
        if fused == 2:
            return lambda: minimlx_native.quantized_swiglu(x, *weights[0], *weights[1], 32, bits, exact=exact)
        return lambda: minimlx_native.quantized_matmul(x, *weights[0], 32, bits, exact=exact)

    paths = {"float": kernel(True), "integer": kernel(False)}
    if rows == 1 and fused == 1:
        dense = mx.dequantize(*weights[0], 32, bits)
        mx.eval(dense)
        paths["blas"] = lambda: x @ dense.T
        paths["mlx"] = lambda: mx.quantized_matmul(x, *weights[0], group_size=32, bits=bits)
    times = {path: [] for path in paths}
    repeats = max(5, repeats * 576 * 576 // (out_dims * in_dims * fused))
    for fn in paths.values():
        timed(fn)
    for _ in range(repeats):
        for path, fn in paths.items():
            times[path].append(timed(fn))
    us = {path: statistics.median(t) * 1e6 for path, t in times.items()}
    references = " | ".join(f"{us[path]:.0f}" if path in us else "" for path in ("blas", "mlx"))
    ratio = us["float"] / us["integer"]
    print(f"| {name} | {rows} | {us['float']:.0f} | {us['integer']:.0f} | {ratio:.2f}x | {references} |")


def decode_rate(products: str) -> float:
    env = dict(os.environ, MINIMLX_NATIVE_PRODUCTS=products)
    command = [sys.executable, "-m", "minimlx", "bench", "smollm2-135m", "--repeats", "1", "--json"]
    result = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["decode_tps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,2,4,8,16,27", help="input rows of the products, comma-separated")
    parser.add_argument("--scales", choices=("float16", "float32"), default="float16", help="scales' and biases' type")
    parser.add_argument("--no-decode", action="store_true", help="only the products")
    args = parser.parse_args()
    print(
        f"native kernel: {minimlx_native.isa} (integer products: {minimlx_native.integer_isa}), "
        f"{minimlx_native.threads} threads; BLAS {minimlx.cpu.blas.loaded}; {args.scales} scales"
    )
    print(
        "| product | rows | float32 inputs, us | integer products, us | integer over float | "
        "float32 BLAS, us | mx.quantized_matmul, us |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, shape in SHAPES.items():
            products(name, shape, rows, args.repeats, getattr(mx, args.scales))
    if args.no_decode:
        return
    rates = {"float": [], "integer": []}
    for _ in range(args.rounds):
        for products_ in rates:
            rates[products_].append(decode_rate(products_))
    print()
    print("| SmolLM2-135M decode, 128-token context | tok/s (median) | rounds |")
    print("| --- | ---: | --- |")
    for products_, r in rates.items():
        print(
            f"| MINIMLX_NATIVE_PRODUCTS={products_} | {statistics.median(r):.1f} | {', '.join(f'{v:.1f}' for v in r)} |"
        )
    ratio = statistics.median(rates["integer"]) / statistics.median(rates["float"])
    print(f"\ninteger over float products: {ratio:.2f}x decode tok/s")


if __name__ == "__main__":
    main()
