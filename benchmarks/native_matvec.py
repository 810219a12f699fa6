"""One matrix-vector product, four ways: the native kernel on packed weights, float32 BLAS on the
dequantized weight, and MLX's `quantized_matmul` on the same packed weights.

    python benchmarks/native_matvec.py [--repeats 200]

Shapes are SmolLM2-135M's FFN down projection (576 x 1536) and its tied head (49,152 x 576). GB/s
counts the bytes of weights each path reads per product (packed words + float32 scales and biases,
or the float32 matrix); the figures are medians over repeats, interleaved so that a busy machine
slows all paths alike.
"""

import argparse
import statistics
import time

import mlx.core as mx

import minimlx  # noqa: F401  (loads the best BLAS before MLX)
import minimlx_native


def timed(fn, x) -> float:
    start = time.perf_counter()
    mx.eval(fn(x))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"native kernel: {minimlx_native.isa}, {minimlx_native.threads} threads; BLAS {minimlx.cpu.blas.loaded}")
    print("| shape (rows x cols) | bits | path | MB read | us per product | GB/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for rows, cols in ((576, 1536), (49152, 576)):
        for bits in (4, 8):
            weight = mx.random.normal((rows, cols))
            packed, scales, biases = mx.quantize(weight, 32, bits)
            dense = mx.dequantize(packed, scales, biases, 32, bits)
            mx.eval(packed, scales, biases, dense)
            x = mx.random.normal((1, cols))
            paths = {
                "native kernel": (
                    lambda v: minimlx_native.quantized_matmul(v, packed, scales, biases, 32, bits),
                    packed.nbytes + scales.nbytes + biases.nbytes,
                ),
                "float32 BLAS": (lambda v: v @ dense.T, dense.nbytes),
                "mx.quantized_matmul": (
                    lambda v: mx.quantized_matmul(v, packed, scales, biases, group_size=32, bits=bits),
                    packed.nbytes + scales.nbytes + biases.nbytes,
                ),
            }
            times = {name: [] for name in paths}
            for _ in range(3):
                for fn, _ in paths.values():
                    timed(fn, x)
            for i in range(args.repeats):
                for name, (fn, _) in paths.items():
                    if name != "mx.quantized_matmul" or i < max(3, args.repeats // 20):
                        times[name].append(timed(fn, x))
            for name, (_, nbytes) in paths.items():
                t = statistics.median(times[name])
                size = f"{nbytes / 1e6:.1f} | {t * 1e6:.0f} | {nbytes / t / 1e9:.1f}"
                print(f"| {rows} x {cols} | {bits} | {name} | {size} |")


if __name__ == "__main__":
    main()
