"""minimlx's native CPU kernel: `quantized_matmul(x, w, scales, biases, group_size, bits)` computes
`x @ dequantize(w, scales, biases).T` in float32 from MLX affine-packed weights (4 or 8 bits, groups of
a multiple of 32), streaming the packed bytes instead of a float32 copy, and `quantized_swiglu` the gated
product silu(x @ gate.T) * (x @ up.T) of two such weights in one op. `matmul(x, w)` is `x @ w.T` for float32
weights, tiled for many rows of x (a prompt's chunk), and `matmul_swiglu(x, gate_w, up_w)` its gated form. `causal_attention(q, k, v, scale)` is causal
softmax attention in float32 that computes only the unmasked scores (grouped query heads included),
`masked_attention(q, k, v, scale, mask)` the same with keys hidden by a boolean mask as well,
`quantized_attention(q, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, scale, group_size, bits, mask)`
the same over keys and values quantized as `mx.quantize` holds them (8 or 4 bits), reading the codes directly, and
`silu(x)` is x * sigmoid(x) with a vectorized exp (`swiglu(gate, up)`: silu(gate) * up); `rms_norm(x, weight, eps)` and `rotate(x, cos, sin, dims,
traditional)` (rotary embedding by given angles) are single ops where MLX's CPU backend composes several, and
`block_step(...)` is a pre-norm block's one-token decode step in one op, which writes the token's keys and values
into the cache's buffers; `delta_step(...)` is a Gated DeltaNet's one-token step after its projections
(convolution, normed q and k, gates, the delta rule over its state, the gated norm) in one op, and
`delta_block_step(...)` the whole pre-norm block around it (GGUF blocks) in one op.
`block_matmul(x, w, type)` is `x @ W.T` for W held as a GGUF file stores it (rows of Q4_K,
Q5_K, Q6_K or Q8_0 blocks, uint8), with integer dot products for a few rows of x, `block_swiglu` its gated form,
`block_gather_matmul(x, w, type, ids)` its form for stacked experts (each row by its expert's weight) and
`block_rows(w, ids, type)` its rows dequantized (an embedding's lookup), and `block_moe(...)` a mixture of experts'
step over such experts (router, chosen experts, weighted sum, shared expert) in one op, `block_geglu` a GeGLU's gated
product (Gemma's) over such weights (`geglu` its gate alone), `block_layer_input` Gemma 4's per-layer input after a block. `isa` names the instruction
set in use (avx512, avx2, neon or scalar), `integer_isa` the one of the integer products (avx512vnni, avxvnni, avx2,
neondot or scalar; `MINIMLX_NATIVE_ISA` names the widest to use), `block_isa` the one of the block products,
`threads` the threads that split the output rows.
"""

import mlx.core as mx

from . import _ext

if _ext.mlx_version != mx.__version__:
    raise ImportError(
        f"minimlx_native was built against mlx {_ext.mlx_version} but mlx {mx.__version__} is installed; "
        "reinstall minimlx to rebuild it: pip install -e ."
    )

quantized_matmul = _ext.quantized_matmul
quantized_swiglu = _ext.quantized_swiglu
matmul = _ext.matmul
matmul_swiglu = _ext.matmul_swiglu
causal_attention = _ext.causal_attention
masked_attention = _ext.masked_attention
quantized_attention = _ext.quantized_attention
silu = _ext.silu
swiglu = _ext.swiglu
rms_norm = _ext.rms_norm
rotate = _ext.rotate
block_step = _ext.block_step
delta_step = _ext.delta_step
delta_block_step = _ext.delta_block_step
block_matmul = _ext.block_matmul
block_swiglu = _ext.block_swiglu
block_gather_matmul = _ext.block_gather_matmul
block_rows = _ext.block_rows
block_moe = _ext.block_moe
block_geglu = _ext.block_geglu
geglu = _ext.geglu
block_layer_input = _ext.block_layer_input
isa: str = _ext.isa
integer_isa: str = _ext.integer_isa
block_isa: str = _ext.block_isa
threads: int = _ext.threads
