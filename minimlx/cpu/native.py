"""The optional native kernel (this repo's `native/`, `pip install ./native`), probed once, at import.

`kernel` is the `minimlx_native` module when it is installed, built for the installed MLX and not switched
off with `MINIMLX_NATIVE=off`; else None, and every CPU form computes with MLX's ops instead.

`exact_products`: whether the kernel's packed products of a few input rows (decode steps) keep their inputs in
float32 (`MINIMLX_NATIVE_PRODUCTS=float`) rather than quantizing them to 8 bits per block of 32 for integer dot
products (`integer`, the default: faster, within the error docs/performance.md states).
"""

import os
import warnings

OPS = (
    "quantized_matmul",
    "quantized_swiglu",
    "matmul",
    "matmul_swiglu",
    "causal_attention",
    "masked_attention",
    "quantized_attention",
    "silu",
    "swiglu",
    "rms_norm",
    "rotate",
    "integer_isa",
)
"""What this minimlx calls: a build that lacks one of them is older than it, and is not used."""


def probe():
    if os.environ.get("MINIMLX_NATIVE", "").lower() in ("0", "off", "false", "no"):
        return None
    try:
        import minimlx_native
    except ImportError:  # not installed, or built for another MLX: MLX's ops serve
        return None
    missing = [op for op in OPS if not hasattr(minimlx_native, op)]
    if missing:
        warnings.warn(
            f"minimlx: the installed native kernel is older than minimlx (it lacks {', '.join(missing)}) and is not "
            "used; rebuild it: pip install --force-reinstall ./native",
            stacklevel=2,
        )
        return None
    return minimlx_native


def products_are_exact() -> bool:
    products = os.environ.get("MINIMLX_NATIVE_PRODUCTS", "integer").lower()
    if products not in ("integer", "float"):
        warnings.warn(
            f"minimlx: MINIMLX_NATIVE_PRODUCTS={products} is neither integer nor float; integer products are used",
            stacklevel=2,
        )
    return products == "float"


kernel = probe()
exact_products = products_are_exact()
