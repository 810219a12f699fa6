"""The CPU backend beside core: the BLAS under MLX's float32 matmuls, the optional native kernel, and the CPU
forms of core parts that loading swaps in when the model runs on the CPU.

Importing this package loads nothing: `minimlx/__init__.py` imports `cpu.blas` before `mlx.core` (the BLAS
must be in the global symbol scope first), and the rest is imported only where the CPU runs the model.
"""
