"""Float32 linear maps whose many-row products (a prompt's chunk, a batch of sequences) run in the native kernel.

MLX multiplies float32 matrices on the CPU through BLAS's `sgemm`. With the optional native kernel installed
(`pip install ./native`), products of at least `NATIVE_ROWS` input rows go to its register-tiled product
instead (native/src/gemm.h): one Zen 4 core runs it at 54-58 GMAC/s where MKL's sgemm runs at 50-51, and inside
MLX it needs no OpenMP team to wake, so a 128-token SmolLM2 prefill's 210 products take 145 ms instead of 195
(docs/performance.md). A single row (a decode step) stays on BLAS's matrix-vector product, which streams the
weights once.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .quantized import native_kernel

NATIVE_ROWS = 2
"""Fewest input rows a product sends to the native kernel: SmolLM2's 30 layers of products took 43.1 ms there
against 48.1 with MKL at 2 rows, and 41.0 against 30.8 at 1 row, where BLAS's matrix-vector product streams the
weights once and the kernel pads the row to a whole panel (`benchmarks/native_gemm.py`, a 2-core Zen 4)."""


def native_product(x: mx.array, weight: mx.array):
    """The native kernel's module when `x @ weight.T` should run in it (float32, enough rows, not switched off),
    else None. (Only models whose kernel has `matmul` get `NativeLinear`s: `use_native_products`.)"""
    native = native_kernel()
    if native is None or x.dtype != mx.float32 or weight.dtype != mx.float32:
        return None
    return native if x.size // max(x.shape[-1], 1) >= NATIVE_ROWS else None


class NativeLinear(nn.Linear):
    """`nn.Linear` whose products of many rows run in the native kernel's float32 GEMM."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "NativeLinear":
        """The same parameters (the arrays themselves, not copies) in this form."""
        out_dims, in_dims = linear.weight.shape
        native = cls(in_dims, out_dims, bias="bias" in linear)
        native.update(linear.parameters())
        return native

    def __call__(self, x: mx.array) -> mx.array:
        native = native_product(x, self.weight)
        if native is None:
            return super().__call__(x)
        y = native.matmul(x, self.weight)
        return y + self.bias if "bias" in self else y


def native_swiglu(x: mx.array, gate: nn.Module, up: nn.Module) -> mx.array | None:
    """silu(gate(x)) * up(x) in one native op when both are bias-free `NativeLinear`s and the product goes
    native (the two products share one pass over the kernel's threads); else None."""
    if type(gate) is not NativeLinear or type(up) is not NativeLinear or "bias" in gate or "bias" in up:
        return None
    native = native_product(x, gate.weight)
    if native is None or gate.weight.shape != up.weight.shape or up.weight.dtype != mx.float32:
        return None
    return native.matmul_swiglu(x, gate.weight, up.weight)


def use_native_products(model: nn.Module) -> None:
    """Give every plain `nn.Linear` of `model` the `NativeLinear` form (nothing when the kernel is absent)."""
    if not hasattr(native_kernel(), "matmul"):
        return

    def swap(path: str, module: nn.Module) -> nn.Module:
        return NativeLinear.from_linear(module) if type(module) is nn.Linear else module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
