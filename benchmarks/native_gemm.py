"""The products of SmolLM2-135M's 30 layers for one chunk of rows: MLX's float32 matmul (on the BLAS minimlx
loaded) against the native kernel's float32 GEMM and its 4-bit packed products (groups of 32, as the GGUF's Q4_1;
blocks of 8 rows below 28 rows, weights dequantized block by block into the GEMM from 28), as a model runs them
(each layer's input the previous layer's output; gate and up with the SwiGLU gate: the native sides in one op,
the BLAS side two products and the native `swiglu`).

    python benchmarks/native_gemm.py [--rows 1 2 4 8 32 128 512] [--repeats 15]

Best of `repeats` per row count, the two sides interleaved so that a busy machine slows both alike.
"""

import argparse
import time

import mlx.core as mx

import minimlx  # noqa: F401  (loads the best BLAS before MLX)
import minimlx_native

LAYERS, DIMS, KV_DIMS, HIDDEN = 30, 576, 192, 1536


def layer_weights() -> dict[str, mx.array]:
    shapes = {
        "q": (DIMS, DIMS),
        "k": (KV_DIMS, DIMS),
        "v": (KV_DIMS, DIMS),
        "o": (DIMS, DIMS),
        "gate": (HIDDEN, DIMS),
        "up": (HIDDEN, DIMS),
        "down": (DIMS, HIDDEN),
    }
    return {name: mx.random.normal(shape) * 0.02 for name, shape in shapes.items()}


def blas_layers(x: mx.array, layers: list[dict]) -> list[mx.array]:
    outputs = []
    for w in layers:
        q, k, v = x @ w["q"].T, x @ w["k"].T, x @ w["v"].T
        gated = minimlx_native.swiglu(x @ w["gate"].T, x @ w["up"].T)
        x = x + (q @ w["o"].T) * 1e-3 + (gated @ w["down"].T) * 1e-3
        outputs += [k, v]
    return outputs + [x]


def native_layers(x: mx.array, layers: list[dict]) -> list[mx.array]:
    product, outputs = minimlx_native.matmul, []
    for w in layers:
        q, k, v = product(x, w["q"]), product(x, w["k"]), product(x, w["v"])
        gated = minimlx_native.matmul_swiglu(x, w["gate"], w["up"])
        x = x + product(q, w["o"]) * 1e-3 + product(gated, w["down"]) * 1e-3
        outputs += [k, v]
    return outputs + [x]


def packed_layers(x: mx.array, layers: list[dict]) -> list[mx.array]:
    outputs = []

    def product(x, packed):
        return minimlx_native.quantized_matmul(x, *packed, 32, 4)

    for w in layers:
        q, k, v = product(x, w["q"]), product(x, w["k"]), product(x, w["v"])
        gated = minimlx_native.quantized_swiglu(x, *w["gate"], *w["up"], 32, 4)
        x = x + product(q, w["o"]) * 1e-3 + product(gated, w["down"]) * 1e-3
        outputs += [k, v]
    return outputs + [x]


def best_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128, 512])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    layers = [layer_weights() for _ in range(LAYERS)]
    packed = [{name: mx.quantize(w, 32, 4) for name, w in layer.items()} for layer in layers]
    mx.eval(layers, packed)
    print(f"native kernel: {minimlx_native.isa}, {minimlx_native.threads} threads; BLAS {minimlx.cpu.blas.loaded}\n")
    print("| rows | float32 BLAS ms | float32 native ms | BLAS / native | 4-bit native ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        x = mx.random.normal((rows, DIMS))
        mx.eval(x)
        runs = {"blas": (blas_layers, layers), "native": (native_layers, layers), "packed": (packed_layers, packed)}
        times = {name: [] for name in runs}
        for _ in range(3):  # interleaved rounds; the first also warms up
            for name, (run, weights) in runs.items():
                times[name].append(best_ms(lambda: run(x, weights), args.repeats))
        blas, native, packed_ms = (min(times[name]) for name in runs)
        print(f"| {rows} | {blas:.1f} | {native:.1f} | {blas / native:.2f}x | {packed_ms:.1f} |")


if __name__ == "__main__":
    main()
