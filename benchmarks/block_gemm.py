"""A prompt's products with GGUF blocks: the float32 GEMM over dequantized rows (`exact`) against the integer GEMM
(`prompt`, AVX-512 VNNI), on a 1.1B LLaMA's shapes (TinyLlama's: width 2048, FFN 5632) in Q4_K, Q6_K and Q8_0.

    python benchmarks/block_gemm.py [--rows 256] [--repeats 5]

Each cell is the multiply-adds x 2 per second of the process's CPU time (both threads' together), the best of
`repeats`, the two sides interleaved: CPU time rather than wall time, so that other work on a busy machine slows
neither side's figure much; `MINIMLX_NATIVE_THREADS=1` gives one core's.
"""

import argparse
import resource
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import minimlx  # noqa: F401  (loads the best BLAS before MLX)
import minimlx_native

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPES = {"gate/up": (5632, 2048), "down": (2048, 5632), "q/o": (2048, 2048)}
TYPES = {"Q4_K": 12, "Q6_K": 14, "Q8_0": 8}


def random_blocks(kind: str, rows: int, cols: int) -> mx.array:
    """A random (rows, cols) weight quantized by ggml's reference quantizer, as llama-quantize writes it."""
    from gguf import GGMLQuantizationType
    from llamacpp import ggml_quantize

    weight = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    return mx.array(ggml_quantize(GGMLQuantizationType[kind], weight))


def cpu_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime


def rate(x: mx.array, blocks: mx.array, kind: int, **settings) -> float:
    """Multiply-adds x 2 per CPU second of one product."""
    start = cpu_seconds()
    mx.eval(minimlx_native.block_matmul(x, blocks, kind, **settings))
    rows, cols = x.shape[0], x.shape[1]
    return 2 * rows * cols * blocks.shape[0] / max(cpu_seconds() - start, 1e-9) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"block_isa {minimlx_native.block_isa}, {minimlx_native.threads} threads, {args.rows} rows of x\n")
    print("| type | weight | float32 GEMM (exact), G/s | integer GEMM (prompt), G/s | integer / float |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, kind in TYPES.items():
        for shape_name, (rows, cols) in SHAPES.items():
            blocks = random_blocks(name, rows, cols)
            x = mx.random.normal((args.rows, cols), key=mx.random.key(0))
            mx.eval(blocks, x)
            best = {"exact": 0.0, "prompt": 0.0}
            for _ in range(args.repeats):
                best["exact"] = max(best["exact"], rate(x, blocks, kind, exact=True))
                best["prompt"] = max(best["prompt"], rate(x, blocks, kind, prompt=True))
            ratio = best["prompt"] / best["exact"]
            cells = f"{best['exact']:.0f} | {best['prompt']:.0f} | {ratio:.2f}x"
            print(f"| {name} | {shape_name} {rows}x{cols} | {cells} |")


if __name__ == "__main__":
    main()
