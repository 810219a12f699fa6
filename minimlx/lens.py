"""The logit lens, importable as `minimlx.lens` (implemented in `minimlx.anatomy.lens`)."""

from .anatomy.lens import LensResult, layer_distributions, logit_lens, unembed

__all__ = ["LensResult", "layer_distributions", "logit_lens", "unembed"]
