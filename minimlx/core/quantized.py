"""Quantized forms of core parts whose weights are stacks of matrices (experts, per-head maps).

`nn.quantize` swaps every leaf module that has `to_quantized(group_size, bits, mode)`; MLX gives
`Linear` and `Embedding` theirs, and the stacked parts here get the same treatment: the weight
packed into unsigned integers with a scale (and, in affine mode, a bias) per group of
`group_size` input features.
"""

import mlx.core as mx
import mlx.nn as nn


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
