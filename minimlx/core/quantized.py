"""Quantized forms of core parts whose weights are stacks of matrices (experts, per-head maps).

`nn.quantize` swaps every leaf module that has `to_quantized(group_size, bits, mode)`; MLX gives
`Linear` and `Embedding` theirs, and the stacked parts here get the same treatment: the weight
packed into unsigned integers with a scale (and, in affine mode, a bias) per group of
`group_size` input features.

On the CPU, linear maps and embeddings in the layouts of the optional native kernel (`pip install
./native`: affine 4- and 8-bit, groups of 32 or 64) take `KernelLinear` / `KernelEmbedding` forms
instead, whose products read the packed weights directly.
"""

import os

import mlx.core as mx
import mlx.nn as nn

try:
    import minimlx_native
except ImportError:  # the kernel is optional: without it, packed weights are dequantized on the CPU
    minimlx_native = None


class QuantizedWeight(nn.Module):
    """Holds `weight` (packed), `scales` and, for affine quantization, `biases` of a float weight."""

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        self.freeze()

    def quantization(self) -> dict:
        """The keyword arguments of MLX's quantized matmuls."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def native_kernel():
    """The `minimlx_native` package (this repo's native/: quantized matrix products on the CPU that read
    packed weights directly) when it is installed and not switched off with `MINIMLX_NATIVE=off`, else None."""
    switched_off = os.environ.get("MINIMLX_NATIVE", "").lower() in ("0", "off", "false", "no")
    return None if switched_off else minimlx_native


def kernel_runs(module: nn.Module, group_size: int, bits: int, mode: str) -> bool:
    """Whether the native kernel computes `module`'s products: linear maps and embeddings (whose `as_linear`
    is a tied head) in affine 4- or 8-bit with groups of a multiple of 32."""
    return type(module) in KERNEL_FORMS and mode == "affine" and bits in (4, 8) and group_size % 32 == 0


class KernelLinear(nn.QuantizedLinear):
    """A quantized linear map whose products run in the native kernel, in float32 (scales included)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = minimlx_native.quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        return y + self.bias if "bias" in self else y


def kernel_swiglu(x: mx.array, gate: nn.Module, up: nn.Module) -> mx.array | None:
    """silu(gate(x)) * up(x) in one native op when both maps are bias-free `KernelLinear`s of one layout (the
    two products share one pass over the kernel's threads, and the silu and product happen on the way); else None."""
    fused = getattr(native_kernel(), "quantized_swiglu", None)  # None too in a build older than the op
    if (
        fused is None
        or type(gate) is not KernelLinear
        or type(up) is not KernelLinear
        or "bias" in gate
        or "bias" in up
    ):
        return None
    if (gate.group_size, gate.bits, gate.weight.shape) != (up.group_size, up.bits, up.weight.shape):
        return None
    return fused(x, gate.weight, gate.scales, gate.biases, up.weight, up.scales, up.biases, gate.group_size, gate.bits)


class KernelEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose tied-head product (`as_linear`) runs in the native kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        return minimlx_native.quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits)


KERNEL_FORMS = {nn.Linear: KernelLinear.from_linear, nn.Embedding: KernelEmbedding.from_embedding}
