"""The native kernel (this repo's `native/`, built with minimlx where it can be: setup.py), probed once, at import.

`kernel` is the `minimlx_native` module when it is installed, built for the installed MLX and not switched
off with `MINIMLX_NATIVE=off`; else None, and every CPU form computes with MLX's ops instead. `note` is then the one
line the commands that run a model print on the CPU: why the kernel is missing and how to get it (None where it is
switched off or not built for the platform).

`exact_products`: whether the kernel's packed products in decode steps (`core.steps.decode_steps`) keep their inputs
in float32 (`MINIMLX_NATIVE_PRODUCTS=float`, or `--exact` on the commands that generate) rather than quantizing them
to 8 bits per block of 32 for integer dot products (the default: faster decoding, within the error
docs/performance.md states, and a token's greedy choice differs from float32's now and then), and in the engine's
prompts' products with GGUF blocks (`core.steps.prompt_steps`, the integer GEMM where the CPU has AVX-512 VNNI);
prompts' other products keep float32 inputs.
"""

import os
import platform
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
    "block_step",
    "delta_step",
    "delta_block_step",
    "integer_isa",
    "block_matmul",
    "block_swiglu",
    "block_gather_matmul",
    "block_rows",
    "block_moe",
    "block_geglu",
    "geglu",
    "block_layer_input",
)
"""What this minimlx calls: a build that lacks one of them is older than it, and is not used."""


PLATFORMS = {("Linux", "x86_64"), ("Linux", "aarch64")}
"""(system, machine) pairs setup.py builds the kernel on."""

UNBUILT = (
    "note: minimlx's native CPU kernel was not built at install, so decoding runs 2-3x slower; to build it, "
    "install a C++ compiler and Python's headers (apt-get install g++ python3-dev) and run pip install -e . again"
)


def probe():
    """(the kernel or None, the note saying why not or None)."""
    if os.environ.get("MINIMLX_NATIVE", "").lower() in ("0", "off", "false", "no"):
        return None, None
    try:
        import minimlx_native
    except ImportError as e:  # MLX's ops serve
        if e.name == "minimlx_native":  # not built
            return None, UNBUILT if (platform.system(), platform.machine()) in PLATFORMS else None
        if e.name is None:  # built for another MLX: its own line says so, with the fix
            return None, f"note: {e}"
        return (
            None,
            f"note: minimlx's native CPU kernel does not load ({e}); reinstall minimlx to rebuild it: pip install -e .",
        )
    missing = [op for op in OPS if not hasattr(minimlx_native, op)]
    if missing:
        warnings.warn(
            f"minimlx: the installed native kernel is older than minimlx (it lacks {', '.join(missing)}) and is not "
            "used; rebuild it: pip install -e .",
            stacklevel=2,
        )
        return None, None
    return minimlx_native, None


def products_are_exact() -> bool:
    products = os.environ.get("MINIMLX_NATIVE_PRODUCTS", "integer").lower()
    if products not in ("integer", "float"):
        warnings.warn(
            f"minimlx: MINIMLX_NATIVE_PRODUCTS={products} is neither integer nor float; integer products are used",
            stacklevel=2,
        )
    return products == "float"


kernel, note = probe()
exact_products = products_are_exact()
