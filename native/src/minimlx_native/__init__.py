"""minimlx's native CPU kernel: `quantized_matmul(x, w, scales, biases, group_size, bits)` computes
`x @ dequantize(w, scales, biases).T` in float32 from MLX affine-packed weights (4 or 8 bits, groups of
a multiple of 32), streaming the packed bytes instead of a float32 copy. `causal_attention(q, k, v, scale)` is causal
softmax attention in float32 that computes only the unmasked scores (grouped query heads included), and
`silu(x)` is x * sigmoid(x) with a vectorized exp. `isa` names the instruction
set in use (avx512, avx2, neon or scalar), `threads` the threads that split the output rows.
"""

import mlx.core as mx

from . import _ext

if _ext.mlx_version != mx.__version__:
    raise ImportError(
        f"minimlx_native was built against mlx {_ext.mlx_version} but mlx {mx.__version__} is installed; "
        "rebuild it: pip install --force-reinstall ./native"
    )

quantized_matmul = _ext.quantized_matmul
causal_attention = _ext.causal_attention
silu = _ext.silu
isa: str = _ext.isa
threads: int = _ext.threads
